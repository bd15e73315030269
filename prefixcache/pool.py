"""The physical block pool: an O(1) free list and the refcounts of blocks outside the index.

Blocks inside the radix index are counted per node (``Node.ref``); this pool only tracks FREE
blocks and *private* ones (a sequence's partial last block, copy-on-write targets, duplicates),
which may be shared by forks.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, 2, ...
        self.refcount = [0] * num_blocks  # of private blocks only
        self.num_private = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, k: int) -> list[int]:
        """Take ``k`` free blocks as private blocks with refcount 1 (caller checked capacity)."""
        if k == 0:
            return []
        free = self._free
        ids = free[-k:]
        del free[-k:]
        ids.reverse()
        rc = self.refcount
        for b in ids:
            rc[b] = 1
        self.num_private += k
        return ids

    def share(self, ids: list[int]) -> None:
        """One more owner for each private block (a fork)."""
        rc = self.refcount
        for b in ids:
            rc[b] += 1

    def drop(self, ids: list[int]) -> None:
        """One owner fewer for each private block; blocks nobody owns become free."""
        rc, free = self.refcount, self._free
        for b in ids:
            rc[b] -= 1
            if rc[b] == 0:
                free.append(b)
                self.num_private -= 1

    def to_index(self, ids: list[int]) -> None:
        """Private blocks (refcount 1) that the index now owns."""
        rc = self.refcount
        for b in ids:
            rc[b] = 0
        self.num_private -= len(ids)

    def give_back(self, ids: list[int]) -> None:
        """Blocks evicted from the index become free."""
        self._free.extend(ids)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def reset(self) -> None:
        """Every block free again."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.refcount = [0] * self.num_blocks
        self.num_private = 0
