"""The host-memory tier: full blocks evicted from the GPU index, kept in host slots.

The tier is exclusive of the GPU index: a block lives on one of them at most. Entries are keyed by
their 16-byte digest and remember their chain parent's digest (the namespace seed for a first
block), their token ids and their block position, so a lookup can continue a GPU match on host
and verify the tokens. Children are tracked per parent digest, also while the parent itself is on
the GPU, so the tier knows its leaves: it evicts only leaves (least recently stored first), which
keeps it prefix-closed (every entry's parent is on the GPU index, on host, or is the seed).

A slot freed by a load is not handed out again until ``release_deferred()``: the load that reads
it may not have run yet.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from prefixcache.blocks.namespace import Namespace

_new = tuple.__new__  # a NamedTuple from a tuple, in C (hot path)


class HostEntry(NamedTuple):
    """One block on host."""

    slot: int
    parent: bytes  # digest of the chain's previous block (the seed for block 0)
    tokens: bytes  # int32 LE token ids of the block
    position: int  # block index in its sequence
    namespace: Namespace
    stamp: int  # store order: the LRU key


class HostTier:
    """Host slots ``0 .. capacity-1``, their entries and an LRU over leaf entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[bytes, HostEntry] = {}
        self.children: dict[bytes, set[bytes]] = {}  # parent digest -> child digests on host
        self._free = list(range(capacity - 1, -1, -1))  # a stack: pops 0, 1, 2, ...
        self.deferred: list[int] = []  # freed by loads of the current step
        self._leaves: list[tuple[int, bytes]] = []  # lazy heap of (stamp, digest)
        self._stamp = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def get(self, digest: bytes) -> HostEntry | None:
        return self.entries.get(digest)

    def is_leaf(self, digest: bytes) -> bool:
        return digest in self.entries and digest not in self.children

    def leaf_records(self) -> set[tuple[int, bytes]]:
        """The heap's (stamp, digest) records (integrity checks)."""
        return set(self._leaves)

    # ---- changes --------------------------------------------------------------------------
    def put_run(
        self,
        digests: list[bytes],
        parent: bytes,
        run: bytes,
        position: int,
        namespace: Namespace,
    ) -> tuple[list[int], list[tuple[bytes, HostEntry]]]:
        """Store a chain of blocks (not on host yet; ``parent`` is the first one's parent digest,
        ``run`` their token bytes), first block first, evicting leaf entries to make room but
        never a stored block's parent. Stops at the first block no room can be made for.
        Returns the slots of the blocks stored (a leading part of the run) and the entries
        evicted."""
        free, entries, children = self._free, self.entries, self.children
        bb = len(run) // len(digests)
        slots: list[int] = []
        evicted: list[tuple[bytes, HostEntry]] = []
        stamp = self._stamp
        for i, digest in enumerate(digests):
            if not free:
                kept = None
                while not free:
                    record = self._pop_leaf()
                    if record is None:
                        break
                    if record[1] == parent:
                        kept = record
                        continue
                    evicted.append((record[1], self.remove(record[1], defer=False)))
                if kept is not None:
                    heapq.heappush(self._leaves, kept)
                if not free:
                    break
            slot = free.pop()
            stamp += 1
            entries[digest] = _new(
                HostEntry,
                (slot, parent, run[i * bb : (i + 1) * bb], position + i, namespace, stamp),
            )
            siblings = children.get(parent)
            if siblings is None:
                children[parent] = {digest}
            else:
                siblings.add(digest)
            slots.append(slot)
            parent = digest
        self._stamp = stamp
        if slots and parent not in children:  # the last block stored is a leaf; the rest are not
            heapq.heappush(self._leaves, (stamp, parent))
        self._compact()
        return slots, evicted

    def remove(self, digest: bytes, *, defer: bool) -> HostEntry:
        """Take one entry off host (its children stay); its slot is free now or, with
        ``defer``, at ``release_deferred()``."""
        entry = self.entries.pop(digest)
        siblings = self.children[entry.parent]
        siblings.discard(digest)
        if not siblings:
            del self.children[entry.parent]
            up = self.entries.get(entry.parent)
            if up is not None:  # the parent became a leaf
                heapq.heappush(self._leaves, (up.stamp, entry.parent))
        (self.deferred if defer else self._free).append(entry.slot)
        return entry

    def drop_below(self, digest: bytes) -> list[tuple[bytes, HostEntry]]:
        """Take every entry descending from ``digest`` off host, parents before children;
        their slots are free at once. ``digest`` itself is not touched."""
        out: list[tuple[bytes, HostEntry]] = []
        stack = list(self.children.get(digest, ()))
        while stack:
            d = stack.pop()
            stack.extend(self.children.get(d, ()))
            out.append((d, self.remove(d, defer=False)))
        return out

    def release_deferred(self) -> None:
        """Slots freed by loads become free: the loads that read them have run."""
        if self.deferred:
            self._free.extend(self.deferred)
            self.deferred.clear()

    def clear(self) -> None:
        """Every slot free again, every entry gone."""
        self.entries.clear()
        self.children.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self.deferred.clear()
        self._leaves.clear()

    # ---- internals ------------------------------------------------------------------------
    def _pop_leaf(self) -> tuple[int, bytes] | None:
        """The least recently stored leaf's record, taken off the heap (None: no leaf)."""
        heap, entries, children = self._leaves, self.entries, self.children
        while heap:
            stamp, digest = heapq.heappop(heap)
            entry = entries.get(digest)
            if entry is not None and entry.stamp == stamp and digest not in children:
                return stamp, digest
        return None

    def _compact(self) -> None:
        """Drop stale heap records once they outnumber the entries."""
        if len(self._leaves) > 2 * len(self.entries) + 64:
            entries, children = self.entries, self.children
            self._leaves = [
                (s, d)
                for s, d in set(self._leaves)
                if d in entries and entries[d].stamp == s and d not in children
            ]
            heapq.heapify(self._leaves)
