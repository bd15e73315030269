"""The fleet index in one process: one dict entry per block digest, replicas as bits of a mask.

Each known replica owns a slot ``r``; a digest maps to an int whose bit ``2r`` says replica ``r``
holds the block on GPU and bit ``2r + 1`` on CPU. A block shared by many replicas is one entry, and
the masks are interned, so the common masks exist once. ``match`` walks the prompt's digests once,
carrying the set of replicas still matching as a mask.

Limits: at most ``max_replicas`` replicas (``FleetCapacityError`` beyond) and at most
``max_blocks_per_replica`` blocks per replica. A store that would take a replica past its cap
refuses the blocks beyond it and counts them in ``overflow(replica)``; the blocks it refuses are
the tail of the stored run, so the replica's holdings stay prefix-closed. (Dropping the oldest
entries instead would need a per-replica order, which would double the memory per block.)

``clear`` and ``drop_replica`` scan every entry: O(indexed blocks), for rare events.

One writer (the event ingestion) and any number of readers may use it at once: every read that
walks a map walks a copy taken in one step, so a concurrent write never breaks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from prefixcache.blocks.hashing import DIGEST_SIZE
from prefixcache.errors import FleetCapacityError, InvalidArgumentError
from prefixcache.fleet.index.interface import MEDIA, ReplicaMatch
from prefixcache.fleet.index.mask_loops import match_masks, remove_masks, store_masks
from prefixcache.medium import CPU, GPU

DEFAULT_MAX_REPLICAS = 1024
DEFAULT_MAX_BLOCKS_PER_REPLICA = 16_000_000
_ONLY_BYTES = frozenset((bytes,))
_DIGEST_LEN = frozenset((DIGEST_SIZE,))


def check_replica(replica: object) -> str:
    """``replica`` if it is a usable replica name, else ``InvalidArgumentError``."""
    if not isinstance(replica, str) or not replica or len(replica) > 256:
        raise InvalidArgumentError(
            f"replica must be a non-empty str of at most 256 characters, got {replica!r}"
        )
    return replica


def check_digests(digests: object) -> Sequence[bytes]:
    """``digests`` if it is a sequence of 16-byte digests, else ``InvalidArgumentError``."""
    if type(digests) is not list and (
        isinstance(digests, (bytes, str)) or not isinstance(digests, Sequence)
    ):
        raise InvalidArgumentError(
            f"digests must be a sequence of {DIGEST_SIZE}-byte digests, got {type(digests)}"
        )
    if _ONLY_BYTES.issuperset(map(type, digests)) and _DIGEST_LEN.issuperset(map(len, digests)):
        return digests  # the common case, checked in two passes in C
    for d in digests:
        if type(d) is not bytes or len(d) != DIGEST_SIZE:
            raise InvalidArgumentError(f"a digest must be {DIGEST_SIZE} bytes, got {d!r}")
    return digests


def check_medium(medium: object, *, allow_none: bool = False) -> str | None:
    """``medium`` if it is one of ``MEDIA`` (or None where allowed)."""
    if medium is None and allow_none:
        return None
    if medium not in MEDIA:
        raise InvalidArgumentError(f"medium must be one of {MEDIA}, got {medium!r}")
    return str(medium)


class MemoryFleetIndex:
    """``FleetIndex`` in a dict: digest -> interned int mask of (replica, medium) bits."""

    def __init__(
        self,
        *,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
    ) -> None:
        for name, value in (
            ("max_replicas", max_replicas),
            ("max_blocks_per_replica", max_blocks_per_replica),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.max_replicas = max_replicas
        self.max_blocks_per_replica = max_blocks_per_replica
        self._masks: dict[bytes, int] = {}
        self._interned: dict[int, int] = {}
        self._slot: dict[str, int] = {}  # replica -> slot r
        self._names: dict[int, str] = {}
        self._free: list[int] = []  # slots given up by dropped replicas
        self._count: dict[str, int] = {}  # blocks held (any medium)
        self._gpu_count: dict[str, int] = {}  # blocks held on GPU
        self._overflow: dict[str, int] = {}

    # ---- FleetIndex -----------------------------------------------------------------------
    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """``replica`` now holds the blocks ``digests`` (16-byte digests) on ``medium``.

        Blocks beyond the replica's cap are refused and counted in ``overflow``."""
        check_digests(digests)
        where = str(check_medium(medium))
        self.store_unchecked(check_replica(replica), digests, where)

    def store_unchecked(self, replica: str, digests: Sequence[bytes], medium: str) -> None:
        """``store`` for a caller whose arguments are known good (a replica name as
        ``check_replica`` takes, 16-byte digests, one of ``MEDIA``): the same outcome, without
        the checks (an in-process feed that applies a manager's events)."""
        store_masks(self, replica, digests, medium)

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""
        check_digests(digests)
        check_medium(medium, allow_none=True)
        self.remove_unchecked(check_replica(replica), digests, medium)

    def remove_unchecked(
        self, replica: str, digests: Sequence[bytes], medium: str | None = None
    ) -> None:
        """``remove`` for a caller whose arguments are known good (as ``store_unchecked``)."""
        remove_masks(self, replica, digests, medium)

    def clear(self, replica: str) -> None:
        """``replica`` holds nothing any more (restart, ``AllBlocksCleared``); it stays known."""
        r = self._slot.get(check_replica(replica))
        if r is None:
            return
        self._clear_slot(r)
        self._count[replica] = self._gpu_count[replica] = 0

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (removed from the fleet)."""
        r = self._slot.get(check_replica(replica))
        if r is None:
            return
        self._clear_slot(r)
        del self._slot[replica], self._names[r], self._count[replica], self._overflow[replica]
        del self._gpu_count[replica]
        self._free.append(r)

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each known replica holds, one entry per replica."""
        check_digests(digests)
        # a copy of the slots (taken in one C call): the ingestion thread may add a replica
        # while this iterates them
        masks = map(self._masks.get, digests, repeat(0))
        return match_masks(masks, len(digests), self._slot.copy())

    def replicas(self) -> list[str]:
        """Every replica the index knows, sorted."""
        return sorted(self._slot)

    def num_blocks(self, replica: str) -> int:
        """Blocks (on any medium) the index holds for ``replica``."""
        return self._count.get(check_replica(replica), 0)

    def num_blocks_many(self, replicas: Sequence[str], medium: str | None = None) -> dict[str, int]:
        """Blocks held by each of ``replicas`` on ``medium`` (GPU only: the KV capacity a
        replica's free room is measured against; None: any medium)."""
        if medium is not None and check_medium(medium) != GPU:
            raise InvalidArgumentError(f"medium must be {GPU!r} or None, got {medium!r}")
        counts = self._count if medium is None else self._gpu_count
        return {r: counts.get(check_replica(r), 0) for r in replicas}

    # ---- beyond the contract --------------------------------------------------------------
    def longest_elsewhere(self, digests: Sequence[bytes], replica: str) -> int:
        """The most leading blocks of ``digests`` (on any medium) that one replica other than
        ``replica`` holds: ``max`` of ``match``'s ``blocks`` over the others, 0 with none, read
        in one walk that stops where the last of them stops matching."""
        check_digests(digests)
        alive = 0
        for name, r in self._slot.copy().items():
            if name != replica:
                alive |= 1 << (2 * r)
        if not alive:
            return 0
        last = -1
        for i, m in enumerate(map(self._masks.get, digests, repeat(0))):
            if m != last:  # a block like the one before it ends no replica's match
                last = m
                alive &= m | (m >> 1)
                if not alive:
                    return i
        return len(digests)

    def overflow(self, replica: str) -> int:
        """Blocks refused for ``replica`` because it was at ``max_blocks_per_replica``."""
        return self._overflow.get(check_replica(replica), 0)

    def holdings(self, replica: str) -> dict[bytes, frozenset[str]]:
        """Every digest ``replica`` holds and on which media (O(indexed blocks); for checks and
        resynchronisation)."""
        r = self._slot.get(check_replica(replica))
        if r is None:
            return {}
        g, c = 1 << (2 * r), 1 << (2 * r + 1)
        out: dict[bytes, frozenset[str]] = {}
        for d, m in list(self._masks.items()):  # a snapshot: stores may run meanwhile
            if m & (g | c):
                out[d] = frozenset(x for x, b in ((GPU, g), (CPU, c)) if m & b)
        return out

    def num_entries(self) -> int:
        """Distinct digests indexed (each shared by every replica holding it)."""
        return len(self._masks)

    # ---- internals ------------------------------------------------------------------------
    def _register(self, replica: str) -> int:
        r = self._slot.get(replica)
        if r is not None:
            return r
        if len(self._slot) >= self.max_replicas:
            raise FleetCapacityError(
                f"the index already knows {self.max_replicas} replicas (max_replicas); "
                f"drop one before adding {replica!r}"
            )
        r = self._free.pop() if self._free else len(self._slot)
        self._slot[replica] = r
        self._names[r] = replica
        self._count[replica] = self._gpu_count[replica] = 0
        self._overflow[replica] = 0
        return r

    def _clear_slot(self, r: int) -> None:
        both = 3 << (2 * r)
        masks = self._masks
        interned = self._interned
        for d, m in list(masks.items()):
            if m & both:
                m &= ~both
                if m:
                    masks[d] = interned.setdefault(m, m)
                else:
                    del masks[d]
        if len(interned) > 4 * len(masks) + 1024:  # masks nobody uses any more
            self._interned = {m: m for m in masks.values()}
