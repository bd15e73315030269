"""A hash table from 16-byte digests to positive int32 values, in three flat numpy arrays.

A Python dict keyed by digests costs about 100 bytes per entry once the 49-byte ``bytes`` key is
counted; this table costs 20 bytes per slot (the digest's two 64-bit halves and the value) at a
load between 5/16 and 5/8, so 32 to 64 bytes per entry with the digest included and no Python
object kept per entry.

Layout: ``2**bits`` buckets of ``BUCKET`` slots, filled from the left. Each key has two candidate
buckets, one from each half of the digest (multiplied by a 64-bit odd constant, top ``bits`` bits
kept: digests are hashes already; the multiplication keeps chosen digests from piling into one
bucket), and lives in whichever was emptier when it came: a lookup reads both buckets at once, so
a batch of keys (a prompt's digests, an event's run of blocks) costs one vectorised round of numpy
calls, and a handful of keys is walked in Python instead (no numpy call at all). A key whose two
buckets are both full (rare at this load with hashed keys; chosen keys can force it) goes to a
small dict beside the arrays, which the table takes back when it is rebuilt. A value of 0 marks a
free slot and -1 a deleted key (its slot stays taken, and storing that key again reuses it);
deleted keys are dropped when the table grows or is rebuilt.

One writer and any number of readers may use it at once: a reader takes the arrays in one step
(``_arrays``); a writer fills a new slot's key before its value and swaps in rebuilt arrays whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixcache.blocks.hashing import DIGEST_SIZE

BUCKET = 8  # slots per bucket
MAX_LOAD = 0.625  # taken slots (live and deleted) per slot before the table grows
SMALL = 16  # batches up to this many keys are walked in Python
_MIX_INT = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
_MIX = np.uint64(_MIX_INT)
_M64 = (1 << 64) - 1
_BYTE_SUM = np.uint64(0x0101010101010101)  # times 8 bytes of 0/1 read as a uint64: their sum on top
_FIRST_BITS = 4
# low halves, high halves, values, bits, and the three arrays as memoryviews (fast scalar reads)
_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, int, memoryview, memoryview, memoryview]


def digest_keys(digests: Sequence[bytes]) -> np.ndarray:
    """The ``(n, 2)`` uint64 halves of ``n`` 16-byte digests (one copy, no per-digest objects)."""
    if not digests:
        return np.zeros((0, 2), dtype=np.uint64)
    return np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 2)


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The digests of ``(n, 2)`` uint64 key rows, as ``bytes``."""
    raw = np.ascontiguousarray(keys, dtype=np.uint64).tobytes()
    return [raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)]


class DigestTable:
    """16-byte digest -> positive int32 value; absent and deleted keys read as 0."""

    def __init__(self) -> None:
        self._arrays: _Arrays = _empty(_FIRST_BITS)
        self._taken = 0  # slots holding a key, live or deleted
        self._live = 0  # live keys, the overflow's included
        self._overflow: dict[bytes, int] = {}  # keys whose two buckets were full (slot -2)

    def __len__(self) -> int:
        """Keys with a value."""
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        lo, hi, val, *_ = self._arrays
        return lo.nbytes + hi.nbytes + val.nbytes

    # ---- by digest: what the fleet index calls -----------------------------------------------
    def lookup_digests(self, digests: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """(slot, value) of each of the distinct ``digests``: slot -1 where absent (-2: in the
        overflow), value 0 where absent or deleted."""
        if len(digests) > SMALL:
            slots, values = self.lookup(digest_keys(digests))
            return slots.tolist(), values.tolist()
        _, _, _, bits, lo_v, hi_v, val_v = self._arrays
        shift = 64 - bits
        out_slots: list[int] = []
        out_values: list[int] = []
        for d in digests:
            k_lo = int.from_bytes(d[:8], "little")
            k_hi = int.from_bytes(d[8:], "little")
            slot = value = -1
            for b in (((k_lo * _MIX_INT) & _M64) >> shift, ((k_hi * _MIX_INT) & _M64) >> shift):
                for j in range(b * BUCKET, b * BUCKET + BUCKET):
                    v = val_v[j]
                    if v == 0:  # the bucket's first free slot: no key past it
                        break
                    if lo_v[j] == k_lo and hi_v[j] == k_hi:
                        slot, value = j, v
                        break
                if slot >= 0:
                    break
            if slot < 0 and self._overflow:
                value = self._overflow.get(d, 0)
                slot = -2 if value else -1
            out_slots.append(slot)
            out_values.append(max(value, 0))
        return out_slots, out_values

    def assign_digests(
        self, digests: Sequence[bytes], slots: Sequence[int], values: Sequence[int]
    ) -> None:
        """Set the value of each of the distinct ``digests`` (``slots`` from
        ``lookup_digests``): 0 deletes, absent digests with a value are added."""
        if len(digests) > SMALL:
            self.assign(
                digest_keys(digests),
                np.array(slots, dtype=np.int64),
                np.array(values, dtype=np.int32),
            )
            return
        val_v = self._arrays[6]
        new: list[tuple[bytes, int]] = []
        for d, s, v in zip(digests, slots, values, strict=True):
            if s >= 0:
                old = val_v[s]
                if v > 0:
                    self._live += old <= 0
                    val_v[s] = v
                else:
                    self._live -= old > 0
                    val_v[s] = -1
            elif s == -2:
                self._set_overflow(d, v)
            elif v > 0:
                new.append((d, v))
        if new:
            self._make_room(len(new))
            for d, v in new:
                if _put_one(self._arrays, d, v):
                    self._taken += 1
                    self._live += 1
                else:
                    self._set_overflow(d, v)

    # ---- by key rows: vectorised ------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, value) of each ``(n, 2)`` key row: slot -1 where absent (-2: in the overflow);
        value 0 where absent or deleted."""
        arrays = self._arrays
        slots = _locate(arrays, keys)
        values = np.where(slots >= 0, arrays[2][np.maximum(slots, 0)], 0)
        if self._overflow:
            overflow = self._overflow
            for i in np.flatnonzero(slots < 0).tolist():
                v = overflow.get(keys[i].tobytes(), 0)
                if v:
                    slots[i], values[i] = -2, v
        return slots, np.maximum(values, 0)

    def values(self, keys: np.ndarray) -> np.ndarray:
        """The value of each ``(n, 2)`` key row (0: absent or deleted)."""
        return self.lookup(keys)[1]

    def assign(self, keys: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
        """``assign_digests`` for ``(n, 2)`` key rows with ``slots`` from ``lookup``."""
        values = np.asarray(values, dtype=np.int32)
        found = slots >= 0
        if found.any():
            s = slots[found]
            new = values[found]
            val = self._arrays[2]
            old = val[s]
            self._live += int(np.count_nonzero((old <= 0) & (new > 0)))
            self._live -= int(np.count_nonzero((old > 0) & (new <= 0)))
            val[s] = np.where(new > 0, new, -1)
        for i in np.flatnonzero(slots == -2).tolist():
            self._set_overflow(keys[i].tobytes(), int(values[i]))
        add = (slots == -1) & (values > 0)
        n_add = int(np.count_nonzero(add))
        if n_add:
            self._make_room(n_add)
            rest_keys, rest_values = keys[add], values[add]
            stuck = _insert(self._arrays, rest_keys, rest_values)
            self._taken += n_add - len(stuck)
            self._live += n_add - len(stuck)
            for i in stuck.tolist():
                self._set_overflow(rest_keys[i].tobytes(), int(rest_values[i]))

    def remap(self, new_value: np.ndarray) -> None:
        """Replace every live value ``v`` with ``new_value[v]`` (0 there deletes the key)."""
        val = self._arrays[2]
        live = np.flatnonzero(val > 0)
        mapped = new_value[val[live]].astype(np.int32)
        gone = mapped <= 0
        val[live] = np.where(gone, -1, mapped)
        self._live -= int(np.count_nonzero(gone))
        for d, v in list(self._overflow.items()):
            self._set_overflow(d, int(new_value[v]))
        if self._taken > 2 * self._live + BUCKET * 64:  # mostly deleted slots: drop them
            self._rebuild(extra=0)

    def live_values(self) -> np.ndarray:
        """Every live value (one per key), in slot order."""
        val = self._arrays[2]
        live = val[val > 0]
        if self._overflow:
            live = np.concatenate([live, np.fromiter(self._overflow.values(), dtype=np.int32)])
        return live

    def items_where(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``(n, 2)`` keys, values) of the live keys whose value ``v`` has ``wanted[v]`` (values
        past the end of ``wanted`` are not wanted)."""
        lo, hi, val, *_ = self._arrays
        val = val.copy()  # one reading of the values, whatever a writer does meanwhile
        live = np.flatnonzero((val > 0) & (val < len(wanted)))
        live = live[wanted[val[live]]]
        keys, values = np.stack([lo[live], hi[live]], axis=1), val[live]
        extra = [(d, v) for d, v in list(self._overflow.items()) if v < len(wanted) and wanted[v]]
        if extra:
            keys = np.concatenate([keys, digest_keys([d for d, _ in extra])])
            values = np.concatenate([values, np.array([v for _, v in extra], dtype=np.int32)])
        return keys, values

    # ---- growth -------------------------------------------------------------------------------
    def _make_room(self, extra: int) -> None:
        if self._taken + extra > MAX_LOAD * len(self._arrays[2]):
            self._rebuild(extra=extra)

    def _set_overflow(self, digest: bytes, value: int) -> None:
        """Set (a positive value) or delete an overflow key, counting live keys."""
        had = digest in self._overflow
        if value > 0:
            self._overflow[digest] = value
            self._live += not had
        elif had:
            del self._overflow[digest]
            self._live -= 1

    def _rebuild(self, extra: int) -> None:
        """New arrays sized for the live keys plus ``extra`` at about half the growth load, deleted
        keys left out and the overflow's keys taken back in; swapped in whole."""
        lo, hi, val, *_ = self._arrays
        new_bits = _FIRST_BITS  # the smallest size a little under half the growth load
        while (1 << new_bits) * BUCKET * MAX_LOAD * 0.55 < self._live + extra:
            new_bits += 1
        live = np.flatnonzero(val > 0)
        keys = np.stack([lo[live], hi[live]], axis=1)
        values = val[live]
        overflow = dict(self._overflow)
        if overflow:
            keys = np.concatenate([keys, digest_keys(list(overflow))])
            values = np.concatenate([values, np.fromiter(overflow.values(), dtype=np.int32)])
        arrays = _empty(new_bits)
        stuck = _insert(arrays, keys, values).tolist()
        self._overflow = {keys[i].tobytes(): int(values[i]) for i in stuck}
        self._arrays = arrays
        self._taken = len(keys) - len(stuck)
        self._live = len(keys)


def _empty(bits: int) -> _Arrays:
    n = (1 << bits) * BUCKET
    lo = np.zeros(n, dtype=np.uint64)
    hi = np.zeros(n, dtype=np.uint64)
    val = np.zeros(n, dtype=np.int32)
    return lo, hi, val, bits, lo.data, hi.data, val.data


def _buckets(half: np.ndarray, bits: int) -> np.ndarray:
    """A candidate bucket of each key, from one half of it."""
    return ((half * _MIX) >> np.uint64(64 - bits)).astype(np.int64)


def _locate(arrays: _Arrays, keys: np.ndarray) -> np.ndarray:
    """Slot of each key row, -1 where absent: both candidate buckets read at once."""
    lo, hi, val, bits, *_ = arrays
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.int64)
    k_lo = np.ascontiguousarray(keys[:, 0])
    k_hi = np.ascontiguousarray(keys[:, 1])
    rows = np.concatenate([_buckets(k_lo, bits), _buckets(k_hi, bits)])  # (2n,)
    want_lo = np.concatenate([k_lo, k_lo])[:, None]  # (2n, 1)
    want_hi = np.concatenate([k_hi, k_hi])[:, None]
    hit = lo.reshape(-1, BUCKET)[rows] == want_lo  # (2n, BUCKET)
    hit &= hi.reshape(-1, BUCKET)[rows] == want_hi
    hit &= val.reshape(-1, BUCKET)[rows] != 0
    col = hit.argmax(axis=1)  # (2n,)
    found = hit.view(np.uint64).ravel() != 0  # any hit in the row
    slot = np.where(found, rows * BUCKET + col, -1)
    return np.where(slot[:n] >= 0, slot[:n], slot[n:])


def _insert(arrays: _Arrays, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Put absent, distinct key rows with positive values into the emptier of their two
    buckets; the indices of the keys that found both full."""
    lo, hi, val, bits, *_ = arrays
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.int64)
    k_lo = np.ascontiguousarray(keys[:, 0])
    k_hi = np.ascontiguousarray(keys[:, 1])
    first = _buckets(k_lo, bits)
    second = _buckets(k_hi, bits)
    buckets = val.reshape(-1, BUCKET)
    pending = np.arange(n)
    stuck: list[np.ndarray] = []
    while pending.size:
        b1, b2 = first[pending], second[pending]
        n1 = _taken_slots(buckets[b1])
        n2 = _taken_slots(buckets[b2])
        b = np.where(n1 <= n2, b1, b2)
        used = np.minimum(n1, n2)
        full = used >= BUCKET
        if full.any():
            stuck.append(pending[full])
            pending, b, used = pending[~full], b[~full], used[~full]
        # keys choosing one bucket fill its free slots in turn (buckets fill from the left)
        order = np.argsort(b, kind="stable")
        sorted_b = b[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_b[1:] != sorted_b[:-1]]))
        rank = np.empty(len(b), dtype=np.int64)
        rank[order] = np.arange(len(b)) - np.repeat(starts, np.diff(np.append(starts, len(b))))
        fits = used + rank < BUCKET
        slot = b[fits] * BUCKET + used[fits] + rank[fits]
        who = pending[fits]
        lo[slot] = k_lo[who]
        hi[slot] = k_hi[who]
        val[slot] = values[who]  # the value last: a reader sees the key whole or not at all
        pending = pending[~fits]  # their bucket filled up: try again (the other one)
    return np.concatenate(stuck) if stuck else np.zeros(0, dtype=np.int64)


def _taken_slots(rows: np.ndarray) -> np.ndarray:
    """Taken slots of each ``(p, BUCKET)`` row of values: the sum of its 8 "taken" bytes, read
    as one uint64 and multiplied so the sum lands in the top byte."""
    flags = np.ascontiguousarray(rows != 0).view(np.uint64).ravel()
    return ((flags * _BYTE_SUM) >> np.uint64(56)).astype(np.int64)


def _put_one(arrays: _Arrays, digest: bytes, value: int) -> bool:
    """Put one absent digest into the emptier of its two buckets; False when both are full."""
    _, _, _, bits, lo_v, hi_v, val_v = arrays
    shift = 64 - bits
    k_lo = int.from_bytes(digest[:8], "little")
    k_hi = int.from_bytes(digest[8:], "little")
    best = -1
    best_used = BUCKET
    for b in (((k_lo * _MIX_INT) & _M64) >> shift, ((k_hi * _MIX_INT) & _M64) >> shift):
        start = b * BUCKET
        used = 0
        while used < BUCKET and val_v[start + used] != 0:
            used += 1
        if used < best_used:
            best, best_used = start + used, used
    if best < 0:
        return False
    lo_v[best] = k_lo
    hi_v[best] = k_hi
    val_v[best] = value  # the value last: a reader sees the key whole or not at all
    return True
