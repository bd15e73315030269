"""A compact, growable set of 64-bit keys: open addressing over one numpy array.

The infinite-cache shadow remembers every full-block prefix a replay has seen; a Python set of
ints costs about 60 bytes a key, this table 8 bytes a slot at a load of at most three quarters
(it doubles past that), so 11-21 bytes a key. Keys are hash digests, already uniform, so a key's
home slot is its low bits; collisions probe linearly. Slot value 0 means empty; the key 0 itself
is kept in a flag.

Single keys are added from Python through a memoryview of the array (no numpy scalar per access);
growing the table re-inserts every key with vectorized numpy, in rounds of linear probing.
"""

from __future__ import annotations

import numpy as np

_MIN_SLOTS = 1 << 12
_GROW_SLICE = 1 << 20


class KeySet:
    """Distinct unsigned 64-bit keys; ``add`` tells whether a key was new."""

    __slots__ = ("_has_zero", "_limit", "_mask", "_size", "_slots", "_table")

    def __init__(self) -> None:
        self._has_zero = False
        self._size = 0
        self._alloc(_MIN_SLOTS)

    def _alloc(self, slots: int) -> None:
        self._table = np.zeros(slots, dtype=np.uint64)
        self._slots = self._table.data  # a memoryview: plain ints, no numpy scalars
        self._mask = slots - 1
        self._limit = slots * 3 // 4

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes the table holds."""
        return int(self._table.nbytes)

    def __contains__(self, key: int) -> bool:
        if key == 0:
            return self._has_zero
        slots, mask = self._slots, self._mask
        i = key & mask
        while True:
            v = slots[i]
            if v == key:
                return True
            if v == 0:
                return False
            i = (i + 1) & mask

    def add(self, key: int) -> bool:
        """Insert ``key`` (0 <= key < 2**64); True when it was not in the set."""
        if key == 0:
            new = not self._has_zero
            self._has_zero = True
            self._size += new
            return new
        slots, mask = self._slots, self._mask
        i = key & mask
        while True:
            v = slots[i]
            if v == key:
                return False
            if v == 0:
                slots[i] = key
                self._size += 1
                if self._size > self._limit:
                    self._grow()
                return True
            i = (i + 1) & mask

    def update(self, keys: list[int]) -> None:
        """Insert every key of ``keys`` (as ``add`` does, one call for all of them)."""
        slots, mask, limit = self._slots, self._mask, self._limit
        size = self._size
        for key in keys:
            if key == 0:
                if not self._has_zero:
                    self._has_zero = True
                    size += 1
                continue
            i = key & mask
            while True:
                v = slots[i]
                if v == key:
                    break
                if v == 0:
                    slots[i] = key
                    size += 1
                    if size > limit:
                        self._size = size
                        self._grow()
                        slots, mask, limit = self._slots, self._mask, self._limit
                    break
                i = (i + 1) & mask
        self._size = size

    def add_chain(self, keys: list[int]) -> int:
        """Insert every key of ``keys`` (as ``update`` does); returns how many leading keys
        were in the set already, ``len(keys)`` when all of them were."""
        slots, mask = self._slots, self._mask
        count = len(keys)
        for k in range(count):  # the leading keys the set holds
            key = keys[k]
            if key == 0:
                if self._has_zero:
                    continue
                break
            i = key & mask
            while True:
                v = slots[i]
                if v == key:
                    break
                if v == 0:
                    slots[i] = key  # the first absent key, in the empty slot its probe ended at
                    self._size += 1
                    if self._size > self._limit:
                        self._grow()
                    self.update(keys[k + 1 :])
                    return k
                i = (i + 1) & mask
        else:
            return count
        self.update(keys[k:])  # from the absent key 0 on
        return k

    def _grow(self) -> None:
        """Double the table, moving the keys over a slice of the old one at a time, so growing
        needs the two tables and little else."""
        old = self._table
        self._alloc(2 * len(old))
        for start in range(0, len(old), _GROW_SLICE):
            part = old[start : start + _GROW_SLICE]
            _insert_distinct(self._table, part[part != 0])


def _insert_distinct(table: np.ndarray, keys: np.ndarray) -> None:
    """Place distinct nonzero ``keys``, none of them in ``table`` yet, by linear probing."""
    mask = np.uint64(len(table) - 1)
    pending = keys
    slot = keys & mask
    one = np.uint64(1)
    while len(pending):
        empty = table[slot] == 0
        table[slot[empty]] = pending[empty]  # several keys for one slot: one of them wins
        placed = empty & (table[slot] == pending)
        pending, slot = pending[~placed], (slot[~placed] + one) & mask
