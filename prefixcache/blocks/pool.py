"""The physical block pool: an O(1) free list and the refcounts of blocks outside the index.

Blocks inside the radix index are counted per node (``Node.ref``); this pool only tracks FREE
blocks and *private* ones (a sequence's partial last block, copy-on-write targets, duplicates),
which may be shared by forks.

Bookkeeping grows with the blocks in use, not with the pool's size: ids never handed out are not
listed (the free list holds returned ids; fresh ids are counted out in order), and refcounts are
kept for private blocks only. A pool of ``UNBOUNDED`` blocks costs no more than a small one.
Blocks are handed out in the same order as a stack of every id would give them: the most
recently returned first, then fresh ids 0, 1, 2, ...
"""

from __future__ import annotations

from typing import Final

UNBOUNDED: Final = 2**63 - 1  # the capacity of a cache that never runs out of blocks


class Refcounts(dict[int, int]):
    """Owners of each private block; any other block has none."""

    def __missing__(self, block: int) -> int:
        return 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = []  # returned blocks, a stack
        self._fresh = 0  # blocks below this id have been handed out at least once
        self.refcount = Refcounts()  # of private blocks only

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_private(self) -> int:
        return len(self.refcount)

    @property
    def handed_out(self) -> int:
        """Blocks ``0 .. handed_out-1`` have been used; the others were never taken."""
        return self._fresh

    def take(self, k: int) -> list[int]:
        """Take ``k`` free blocks as private blocks with refcount 1 (caller checked capacity)."""
        ids = self.take_unowned(k)
        self.own(ids)
        return ids

    def take_unowned(self, k: int) -> list[int]:
        """Take ``k`` free blocks without owners yet: within the same call the caller hands each
        to the index or ``own``s it (an admission indexes most of its blocks at once, so they
        never need a refcount)."""
        if k == 0:
            return []
        free = self._free
        if k <= len(free):
            ids = free[-k:]
            del free[-k:]
            ids.reverse()
        else:
            ids = free[::-1]
            free.clear()
            start = self._fresh
            self._fresh = start + k - len(ids)
            ids.extend(range(start, self._fresh))
        return ids

    def own(self, ids: list[int]) -> None:
        """Blocks from ``take_unowned`` that stay private: refcount 1."""
        rc = self.refcount
        for b in ids:
            rc[b] = 1

    def share(self, ids: list[int]) -> None:
        """One more owner for each private block (a fork)."""
        rc = self.refcount
        for b in ids:
            rc[b] += 1

    def drop(self, ids: list[int]) -> None:
        """One owner fewer for each private block; blocks nobody owns become free."""
        rc, free = self.refcount, self._free
        for b in ids:
            n = rc[b] - 1
            if n:
                rc[b] = n
            else:
                del rc[b]
                free.append(b)

    def to_index(self, ids: list[int]) -> None:
        """Private blocks (refcount 1) that the index now owns."""
        rc = self.refcount
        for b in ids:
            del rc[b]

    def give_back(self, ids: list[int]) -> None:
        """Blocks evicted from the index become free."""
        self._free.extend(ids)

    def returned_ids(self) -> list[int]:
        """Free blocks that were used before (every free block below ``handed_out``)."""
        return list(self._free)

    def free_ids(self) -> list[int]:
        """Every free block (for small pools: lists the never-used ones too)."""
        return [*self._free, *range(self._fresh, self.num_blocks)]

    def reset(self) -> None:
        """Every block free again."""
        self._free = []
        self._fresh = 0
        self.refcount = Refcounts()
