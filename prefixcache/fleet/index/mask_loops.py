"""The in-memory fleet index's loops over block masks, compiled with the core.

``MemoryFleetIndex.store_unchecked`` and ``remove_unchecked`` are ``store_masks`` and
``remove_masks``; a caller in the same process that applies a manager's events one block at a
time (the fleet replay's index feed) calls them directly, with no Python frame per event.
``match_masks`` is the walk every index's ``match`` ends in (a route's). What the masks mean:
memory.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.medium import CPU, GPU


class MaskIndex(Protocol):
    """The parts of ``MemoryFleetIndex`` its writes change."""

    max_blocks_per_replica: int
    _masks: dict[bytes, int]  # digest -> interned mask of (replica, medium) bits
    _interned: dict[int, int]
    _slot: dict[str, int]  # replica -> slot r
    _count: dict[str, int]  # blocks held (any medium)
    _gpu_count: dict[str, int]  # blocks held on GPU
    _overflow: dict[str, int]

    def _register(self, replica: str) -> int: ...


def store_masks(index: MaskIndex, replica: str, digests: Sequence[bytes], medium: str) -> None:
    """``replica`` now holds ``digests`` on ``medium`` (one of ``MEDIA``); blocks beyond its cap
    are refused and counted in its overflow."""
    r = index._slot.get(replica)
    if r is None:
        r = index._register(replica)
    bit = 1 << (2 * r + (medium == CPU))
    both = 3 << (2 * r)
    masks = index._masks
    interned = index._interned
    count = index._count[replica]
    added = 0
    cap = index.max_blocks_per_replica
    alone = interned.setdefault(bit, bit)  # the mask of a block this replica alone holds
    for k, d in enumerate(digests):
        m = masks.get(d, 0)
        if not m:  # no replica holds it yet: the common case, taken first
            if count >= cap:
                index._overflow[replica] += len(digests) - k
                break
            count += 1
            added += 1
            masks[d] = alone
            continue
        if m & bit:
            continue
        if not m & both:
            if count >= cap:
                index._overflow[replica] += len(digests) - k
                break
            count += 1
        added += 1
        m |= bit
        masks[d] = interned.setdefault(m, m)
    index._count[replica] = count
    if medium == GPU:
        index._gpu_count[replica] += added


def remove_masks(
    index: MaskIndex, replica: str, digests: Sequence[bytes], medium: str | None
) -> None:
    """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""
    r = index._slot.get(replica)
    if r is None:
        return
    both = 3 << (2 * r)
    bits = both if medium is None else 1 << (2 * r + (medium == CPU))
    masks = index._masks
    interned = index._interned
    count = index._count[replica]
    gpu_bit = 1 << (2 * r)
    gpu_count = index._gpu_count[replica]
    gpu_drop = 1 if bits & gpu_bit else 0
    for d in digests:
        m = masks.get(d, 0)
        if m == bits:  # held by this replica alone, on these media alone: the common case
            del masks[d]
            count -= 1
            gpu_count -= gpu_drop
            continue
        if not m & bits:
            continue
        if m & bits & gpu_bit:
            gpu_count -= 1
        m &= ~bits
        if not m & both:
            count -= 1
        if m:
            masks[d] = interned.setdefault(m, m)
        else:
            del masks[d]
    index._count[replica] = count
    index._gpu_count[replica] = gpu_count
    if len(interned) > 4 * len(masks) + 1024:  # masks nobody uses any more
        index._interned = {m: m for m in masks.values()}


def match_masks(masks: Iterable[int], n: int, slots: Mapping[str, int]) -> list[ReplicaMatch]:
    """Per replica (``slots``: name -> slot ``r``), the leading blocks of a chain of ``n`` blocks
    whose masks (bit ``2r`` GPU, ``2r + 1`` CPU) are ``masks``, in order."""
    if not slots:
        return []
    any_alive = 0
    for r in slots.values():
        any_alive |= 1 << (2 * r)
    gpu_alive = any_alive
    any_len: dict[int, int] = {}
    gpu_len: dict[int, int] = {}
    last = -1  # no mask: a block like the one before it ends no replica's match
    for i, m in enumerate(masks):
        if m == last:
            continue
        last = m
        held = (m | (m >> 1)) & any_alive
        if held != any_alive:
            _record(any_alive & ~held, i, any_len)
            any_alive = held
        gpu = m & gpu_alive
        if gpu != gpu_alive:
            _record(gpu_alive & ~gpu, i, gpu_len)
            gpu_alive = gpu
        if not any_alive:
            break
    _record(any_alive, n, any_len)
    _record(gpu_alive, n, gpu_len)
    return [
        ReplicaMatch(name, any_len.get(r, 0), gpu_len.get(r, 0))
        for name, r in sorted(slots.items())
    ]


def _record(gone: int, length: int, out: dict[int, int]) -> None:
    """Give every replica whose even bit is set in ``gone`` the matched ``length``."""
    while gone:
        low = gone & -gone
        out[(low.bit_length() - 1) >> 1] = length
        gone ^= low
