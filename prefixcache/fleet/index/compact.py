"""The in-process fleet index in compact form: at most 64 bytes per (block, replica), the digest
included, where the dict-backed ``MemoryFleetIndex`` costs about 100.

Same contract and behaviour as ``MemoryFleetIndex`` (masks of (replica, medium) bits, interned;
per-replica caps and counts), but the digest -> mask map is a ``DigestTable``: 20 bytes a slot
holding the digest's two halves and the int32 id of an interned mask, so no Python object is kept
per block. The price is time: a store or match goes through a few numpy calls (a handful of
digests through a Python loop over the table's arrays) where the dict answers in one C call, so
writes are several times slower (BENCHMARKS.md has the figures). Pick it with
``index: memory+compact`` when memory, not the event rate, bounds the router: tens of millions of
blocks.

One writer (the event ingestion) and any number of readers may use it at once: the table swaps in
rebuilt arrays whole, a mask id is written only after its mask, and ``clear`` swaps in a new mask
list whole, so a concurrent write never breaks a read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixcache.fleet.index.digest_table import DigestTable, key_bytes
from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.fleet.index.memory import (
    DEFAULT_MAX_BLOCKS_PER_REPLICA,
    DEFAULT_MAX_REPLICAS,
    MemoryFleetIndex,
    check_digests,
    check_medium,
    check_replica,
    match_masks,
)
from prefixcache.medium import CPU, GPU

_FIRST_COLLECT = 1024  # mask ids in use before unused ones are first looked for


class CompactFleetIndex(MemoryFleetIndex):
    """``MemoryFleetIndex`` over a ``DigestTable``: digest -> id of an interned int mask."""

    def __init__(
        self,
        *,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
    ) -> None:
        super().__init__(max_replicas=max_replicas, max_blocks_per_replica=max_blocks_per_replica)
        self._table = DigestTable()
        self._mask_of: list[int] = [0]  # mask id -> mask (id 0: no mask)
        self._id_of: dict[int, int] = {0: 0}  # mask -> its id
        self._free_ids: list[int] = []  # ids no key uses any more
        self._collect_at = _FIRST_COLLECT

    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """``replica`` now holds the blocks ``digests`` (16-byte digests) on ``medium``.

        Blocks beyond the replica's cap are refused and counted in ``overflow``."""
        check_digests(digests)
        check_medium(medium)
        r = self._register(check_replica(replica))
        digests = _distinct(digests)
        if not digests:
            return
        bit = 1 << (2 * r + (medium == CPU))
        both = 3 << (2 * r)
        slots, ids = self._table.lookup_digests(digests)
        mask_of = self._mask_of
        count = self._count[replica]
        added = 0
        cap = self.max_blocks_per_replica
        changed: list[int] = []
        new_ids: list[int] = []
        id_of = self._id_of
        for k, i in enumerate(ids):
            m = mask_of[i]
            if m & bit:
                continue
            if not m & both:
                if count >= cap:
                    self._overflow[replica] += len(digests) - k
                    break
                count += 1
            added += 1
            changed.append(k)
            m |= bit
            new_ids.append(id_of.get(m) or self._intern(m))
        self._count[replica] = count
        if medium == GPU:
            self._gpu_count[replica] += added
        if changed:
            self._table.assign_digests(
                [digests[k] for k in changed], [slots[k] for k in changed], new_ids
            )
            self._maybe_collect()

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""
        check_digests(digests)
        check_medium(medium, allow_none=True)
        r = self._slot.get(check_replica(replica))
        if r is None:
            return
        digests = _distinct(digests)
        if not digests:
            return
        both = 3 << (2 * r)
        bits = both if medium is None else 1 << (2 * r + (medium == CPU))
        slots, ids = self._table.lookup_digests(digests)
        mask_of = self._mask_of
        count = self._count[replica]
        gpu_bit = 1 << (2 * r)
        gpu_count = self._gpu_count[replica]
        changed: list[int] = []
        new_ids: list[int] = []
        for k, i in enumerate(ids):
            m = mask_of[i]
            if not m & bits:
                continue
            if m & bits & gpu_bit:
                gpu_count -= 1
            m &= ~bits
            if not m & both:
                count -= 1
            changed.append(k)
            new_ids.append(self._intern(m) if m else 0)
        self._count[replica] = count
        self._gpu_count[replica] = gpu_count
        if changed:
            self._table.assign_digests(
                [digests[k] for k in changed], [slots[k] for k in changed], new_ids
            )
            self._maybe_collect()

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each known replica holds, one entry per replica."""
        check_digests(digests)
        ids = self._table.lookup_digests(digests)[1]
        # the mask list after the ids: a list taken later never is shorter, so it names them all
        mask_of = self._mask_of
        # a copy of the slots (taken in one C call): the ingestion thread may add a replica
        # while this iterates them
        return match_masks([mask_of[i] for i in ids], len(digests), self._slot.copy())

    def holdings(self, replica: str) -> dict[bytes, frozenset[str]]:
        """Every digest ``replica`` holds and on which media (O(indexed blocks); for checks and
        resynchronisation)."""
        r = self._slot.get(check_replica(replica))
        if r is None:
            return {}
        g, c = 1 << (2 * r), 1 << (2 * r + 1)
        mask_of = list(self._mask_of)
        wanted = np.array([bool(m & (g | c)) for m in mask_of], dtype=bool)
        keys, ids = self._table.items_where(wanted)
        out: dict[bytes, frozenset[str]] = {}
        for d, i in zip(key_bytes(keys), ids.tolist(), strict=True):
            m = mask_of[i]
            out[d] = frozenset(x for x, b in ((GPU, g), (CPU, c)) if m & b)
        return out

    def num_entries(self) -> int:
        """Distinct digests indexed (each shared by every replica holding it)."""
        return len(self._table)

    def nbytes(self) -> int:
        """Bytes of the digest table's arrays (the masks and per-replica counts aside)."""
        return self._table.nbytes

    # ---- internals ------------------------------------------------------------------------
    def _intern(self, mask: int) -> int:
        """The id of ``mask`` (non-zero), given one if it has none."""
        i = self._id_of.get(mask)
        if i is None:
            if self._free_ids:
                i = self._free_ids.pop()
                self._mask_of[i] = mask
            else:
                i = len(self._mask_of)
                self._mask_of.append(mask)
            self._id_of[mask] = i
        return i

    def _maybe_collect(self) -> None:
        """Free the ids of masks no key uses, once there are many more ids than in use."""
        if len(self._mask_of) - len(self._free_ids) < self._collect_at:
            return
        used = np.zeros(len(self._mask_of), dtype=bool)
        used[self._table.live_values()] = True
        used[0] = True
        free = np.flatnonzero(~used).tolist()
        for i in free:
            m = self._mask_of[i]
            if self._id_of.get(m) == i:
                del self._id_of[m]
            self._mask_of[i] = 0
        self._free_ids = free
        self._collect_at = max(_FIRST_COLLECT, 4 * int(used.sum()))

    def _clear_slot(self, r: int) -> None:
        both = 3 << (2 * r)
        # ids keep their number: each names its mask without the replica's bits, in a new list
        # swapped in whole (a concurrent match reads the old list or the new one)
        stripped = [m & ~both for m in self._mask_of]
        id_of: dict[int, int] = {0: 0}
        new_value = np.zeros(len(stripped), dtype=np.int32)
        for i, m in enumerate(stripped):
            if m:
                new_value[i] = id_of.setdefault(m, i)
        self._mask_of = stripped
        self._id_of = id_of
        # keys whose mask lost its last bit are deleted; equal masks share one id again
        self._table.remap(new_value)
        self._collect_at = 0
        self._maybe_collect()


def _distinct(digests: Sequence[bytes]) -> Sequence[bytes]:
    """``digests`` without repeats (first occurrences, in order)."""
    if len(digests) > 1 and len(set(digests)) != len(digests):
        return list(dict.fromkeys(digests))
    return digests
