"""The manager's side of the host tier: offload on eviction, loads on admission, the host
blocks that continue a cached prefix, drops below a digest, and the CPU block events.

The host tier holds blocks evicted from the GPU, exclusive of the index. Every planned copy is
recorded as an ``Offload`` or ``Load`` until ``take_transfers`` hands them out.
"""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

import numpy as np

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.host_tier import HostEntry, HostTier
from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.block_events import BlockRemoved, BlockStored
from prefixcache.manager.bookkeeping.listeners import Listeners
from prefixcache.manager.stats import CacheStats
from prefixcache.manager.transfers import Load, Offload, TransferModel, Transfers

_new = tuple.__new__  # a NamedTuple from a tuple in C (its generated __new__ is a Python call)
_FEW_CHILDREN = 4  # up to this many host children of a block are compared rather than hashed


class HostRun(NamedTuple):
    """The host blocks that continue a cached prefix."""

    digests: list[bytes]  # the blocks to load, in chain order (empty: recompute them all)
    found: int  # blocks found on host (more than loaded when recomputing is cheaper)


class HostOffload:
    """Moves blocks between the GPU index and a host tier and records the copies to run."""

    __slots__ = (
        "block_bytes",
        "block_size",
        "events",
        "hasher",
        "loads",
        "offloads",
        "stats",
        "tier",
        "transfer_model",
    )

    def __init__(
        self,
        tier: HostTier,
        hasher: BlockHasher,
        transfer_model: TransferModel | None,
        stats: CacheStats,
        events: Listeners,
    ) -> None:
        self.tier = tier
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.block_bytes = 4 * hasher.block_size
        self.transfer_model = transfer_model  # None: always load what is found
        self.stats = stats
        self.events = events
        self.offloads: list[Offload] = []  # since the last take_transfers()
        self.loads: list[Load] = []

    def find_run(self, buf: bytes, num_tokens: int, matched: int, digest: bytes) -> HostRun:
        """The host blocks that continue a match of ``matched`` blocks ending at ``digest``
        (at most ``(num_tokens-1) // block_size`` blocks in all, so one prompt token is
        computed). The transfer model may prefer recomputing what was found.

        A host block continues the chain when its parent is the block before and its tokens and
        position are the prompt's: then its digest is the one the prompt's block would hash to.
        Among a few children that is checked directly; only a parent with many children on host
        has the next digest computed to look it up."""
        entries, children = self.tier.entries, self.tier.children
        bb = self.block_bytes
        end = (num_tokens - 1) // self.block_size
        run: list[bytes] = []
        prev = digest
        for i in range(matched, end):
            below = children.get(prev)
            if below is None:  # nothing on host continues this chain
                break
            block = buf[i * bb : (i + 1) * bb]
            found: bytes | None = None
            if len(below) <= _FEW_CHILDREN:
                for d in below:
                    entry = entries[d]
                    if entry.tokens == block and entry.position == i:
                        found = d
                        break
            else:
                start = self.hasher.block_starts(end)[i]
                d = self.hasher.digest(prev + start + block)
                hashed = entries.get(d)
                if hashed is not None and hashed.tokens == block and hashed.parent == prev:
                    found = d
            if found is None:
                break
            run.append(found)
            prev = found
        count = len(run)
        model = self.transfer_model
        if run and model is not None and not model.should_load(count, self.block_size, matched):
            run = []
        return _new(HostRun, (run, count))

    def offload(
        self,
        ids: list[int],
        digests: list[bytes],
        run: bytes,
        prev: bytes,
        position: int,
        namespace: Namespace,
    ) -> None:
        """Put blocks just evicted from the GPU (a chain, first block first; ``prev`` is the
        first one's parent digest, ``run`` their tokens, ``position`` the first one's block
        position) on host, while room can be made; the rest are dropped, with what descends
        from them on host."""
        slots, evicted = self.tier.put_run(digests, prev, run, position, namespace)
        if evicted:
            self.stats.host_evicted_blocks += len(evicted)
            self.emit_removed(evicted)
        stored = len(slots)
        offloads = self.offloads
        for k in range(stored):
            offloads.append(_new(Offload, (ids[k], slots[k])))
        if stored < len(digests):  # no room: they leave the cache, with what is below them
            for gone in digests[stored:]:
                self.drop_below(gone)
        self.stats.offloaded_blocks += stored
        if stored and self.events.callbacks:
            tokens = np.frombuffer(run[: stored * self.block_bytes], dtype="<i4").tolist()
            parent = prev if position else None  # a chain's first block has no parent
            self.events.emit(
                BlockStored(digests[:stored], parent, tokens, self.block_size, namespace, "CPU")
            )

    def unload(self, digests: list[bytes], namespace: Namespace) -> list[int]:
        """Take a run of blocks to load off host; returns their slots (free once the step's
        loads have run)."""
        tier = self.tier
        slots = [tier.remove(d, defer=True).slot for d in digests]
        if self.events.callbacks:
            self.events.emit(BlockRemoved(list(digests), namespace, "CPU"))
        return slots

    def plan_loads(self, slots: list[int], blocks: list[int], *, stepped: bool) -> None:
        """Record the loads of host ``slots`` into GPU ``blocks``. Without steps the caller
        runs them before its next call, so their slots are free again at once."""
        loads = self.loads
        for k in range(len(slots)):
            loads.append(_new(Load, (slots[k], blocks[k])))
        if not stepped:
            self.tier.release_deferred()

    def drop_below(self, digest: bytes) -> None:
        """The block ``digest`` leaves the cache: so does everything below it on host."""
        dropped = self.tier.drop_below(digest)
        if dropped:
            self.stats.host_evicted_blocks += len(dropped)
            self.emit_removed(dropped)

    def replace_recomputed(self, digests: list[bytes]) -> None:
        """Blocks computed again on the GPU: their copies on host go (the GPU's replace them)."""
        tier = self.tier
        replaced = [(d, tier.remove(d, defer=False)) for d in digests if d in tier.entries]
        self.stats.host_evicted_blocks += len(replaced)
        self.emit_removed(replaced)

    def emit_removed(self, entries: list[tuple[bytes, HostEntry]]) -> None:
        """BlockRemoved (CPU) events for entries that left the host tier, one per namespace run."""
        if not self.events.callbacks:
            return
        for namespace, run in groupby(entries, key=lambda item: item[1].namespace):
            self.events.emit(BlockRemoved([digest for digest, _ in run], namespace, "CPU"))

    def end_step(self) -> None:
        """The step's loads have run: the slots they read are free."""
        self.tier.release_deferred()

    def take_transfers(self) -> Transfers:
        """The transfers recorded since the last call, which are forgotten."""
        out = Transfers(self.offloads, self.loads)
        self.offloads, self.loads = [], []
        return out

    def clear(self) -> None:
        """Every host block and every recorded transfer gone."""
        self.tier.clear()
        self.offloads, self.loads = [], []
