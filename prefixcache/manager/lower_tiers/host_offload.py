"""The manager's side of the host tier: offload on eviction, loads on admission, the host
blocks that continue a cached prefix, host copies of blocks computed again, and the CPU block
events.

The host tier keeps blocks evicted from the GPU as host nodes of the radix tree, exclusive of
its GPU nodes (host_tier.py). Every planned copy is recorded as an ``Offload`` or ``Load`` until
``take_transfers`` hands them out.
"""

from __future__ import annotations

from itertools import groupby
from typing import Final, NamedTuple

from prefixcache.blocks.hashing import DIGEST_SIZE, BlockHasher, split_digests
from prefixcache.blocks.host_tier import HostBlock, HostTier
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import MatchResult, Node
from prefixcache.blocks.tokens import token_list
from prefixcache.manager.block_events import BlockRemoved, BlockStored
from prefixcache.manager.listeners import Listeners
from prefixcache.manager.lower_tiers.transfers import Load, Offload, TransferModel, Transfers
from prefixcache.manager.stats import CacheStats
from prefixcache.medium import CPU

D: Final = DIGEST_SIZE
_new = tuple.__new__  # a NamedTuple from a tuple in C (its generated __new__ is a Python call)
_FEW_CHILDREN: Final = 4  # up to this many host children of a node are compared rather than hashed


class HostRun(NamedTuple):
    """The host blocks that continue a cached prefix."""

    digests: list[bytes]  # the blocks to load, in chain order (empty: recompute them all)
    found: int  # blocks found on host (more than loaded when recomputing is cheaper)


class HostOffload:
    """Moves blocks between the GPU and the host tier and records the copies to run."""

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
        stats: CacheStats,
        events: Listeners,
        transfer_model: TransferModel | None,
    ) -> None:
        self.tier = tier  # its index is the manager's (a reset gives it the new one)
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.block_bytes = 4 * hasher.block_size  # int32 token ids per block
        self.transfer_model = transfer_model  # None: always load what is found
        self.stats = stats
        self.events = events
        self.offloads: list[Offload] = []  # since the last take_transfers()
        self.loads: list[Load] = []

    def find_run(self, buf: bytes, num_tokens: int, match: MatchResult) -> HostRun:
        """The host blocks that continue ``match`` (at most ``(num_tokens-1) // block_size``
        blocks in all, so one prompt token is computed). The transfer model may prefer
        recomputing what was found.

        Host nodes hang at the end of the node they continue, so a match that stops inside a
        node has none. A host child continues the prompt when its first block's tokens are the
        prompt's next ones (its position is the same by its place); among a few children that
        is compared directly, and only a node with many host children has the next digest
        computed to look it up."""
        node, n = match.node, match.n
        kids = node.host_children
        if kids is None or match.j < len(node.blocks):
            return _new(HostRun, ([], 0))
        bb = self.block_bytes
        end = (num_tokens - 1) // self.block_size
        run: list[bytes] = []
        prev = match.digest
        i = n
        while i < end:
            found: Node | None = None
            block = buf[i * bb : (i + 1) * bb]
            if len(kids) <= _FEW_CHILDREN:
                for child in kids.values():
                    if child.tokens.startswith(block):
                        found = child
                        break
            else:
                start = self.hasher.block_starts(end)[i]
                hashed = kids.get(self.hasher.digest(prev + start + block))
                if hashed is not None and hashed.tokens.startswith(block):
                    found = hashed
            if found is None:
                break
            k = len(found.blocks)
            if k <= end - i and buf.startswith(found.tokens, i * bb):
                m = k
            else:
                m = self.tier.index.common_blocks(found, buf, i, min(k, end - i))
            run += split_digests(bytes(found.digests[: m * D]))
            i += m
            kids = found.host_children
            if m < k or kids is None:
                break
            prev = run[-1]
        count = len(run)
        if not count:
            return _new(HostRun, ([], 0))
        model = self.transfer_model
        if model is not None and not model.should_load(count, self.block_size, n):
            run = []
        return _new(HostRun, (run, count))

    def offload(self, node: Node, k: int) -> list[int]:
        """Move the last ``k`` blocks of the unheld GPU leaf ``node`` to host, as many as room
        can be made for; the rest leave the cache, with what is below them on host. Returns
        the GPU ids the blocks had (free now)."""
        bb = self.block_bytes
        n = len(node.blocks)
        first = n - k
        ids = node.blocks[first:].tolist()
        events = self.events.callbacks
        if events:  # what the event needs, read before the blocks move
            parent = node.parent
            assert parent is not None
            prev = node.digest(first - 1) if first else parent.last_digest()
            position = node.depth + first
            digests = bytes(node.digests[first * D :])
            run = bytes(node.tokens[first * bb :])
        namespace = node.namespace
        assert namespace is not None
        tier, stats = self.tier, self.stats
        evicted: list[HostBlock] = []
        slots = tier.take_slots(k, evicted)
        dropped = tier.store_tail(node, k, slots)
        if evicted:
            stats.host_evicted_blocks += len(evicted)
            self.emit_removed(evicted)
        stored = len(slots)
        offloads, new, record = self.offloads, _new, Offload  # locals: no global lookups
        for x in range(stored):
            offloads.append(new(record, (ids[x], slots[x])))
        if dropped:
            stats.host_evicted_blocks += len(dropped)
            self.emit_removed(dropped)
        stats.offloaded_blocks += stored
        if stored and events:
            hashes = split_digests(digests[: stored * D])
            tokens = token_list(run[: stored * bb]) if self.events.token_ids else []
            self.events.emit(
                BlockStored(
                    hashes, prev if position else None, tokens, self.block_size, namespace, CPU
                )
            )
        return ids

    def unload(
        self, parent: Node, digests: list[bytes], namespace: Namespace
    ) -> tuple[list[int], list[tuple[int, Node]]]:
        """Take a run of blocks to load (continuing ``parent``) off host; returns their slots
        (free once the step's loads have run) and the holders of what hung below them."""
        slots, holders = self.tier.take_run(parent, digests)
        if self.events.callbacks:
            self.events.emit(BlockRemoved(list(digests), namespace, CPU))
        return slots, holders

    def plan_loads(self, slots: list[int], blocks: list[int], *, stepped: bool) -> None:
        """Record the loads of host ``slots`` into GPU ``blocks``. Without steps the caller
        runs them before its next call, so their slots are free again at once."""
        loads, new, record = self.loads, _new, Load  # locals: no global lookups
        for x in range(len(slots)):
            loads.append(new(record, (slots[x], blocks[x])))
        if not stepped:
            self.tier.release_deferred()

    def take_recomputed(
        self, parent: Node, digests: list[bytes], start: int
    ) -> tuple[int, list[tuple[int, Node]]]:
        """Blocks ``digests[start:]`` computed again after ``parent`` (whose host children hold
        the first): the leading ones' copies on host go (the GPU's replace them). Returns the
        index in ``digests`` after them and the holders of what hung below them."""
        end, gone, holders = self.tier.take_recomputed(parent, digests, start)
        self.stats.host_evicted_blocks += end - start
        self.emit_removed(gone)
        return end, holders

    def drop_below(self, node: Node) -> None:
        """The blocks of ``node`` leave the cache: so does everything below it on host."""
        dropped = self.tier.drop_below(node)
        if dropped:
            self.stats.host_evicted_blocks += len(dropped)
            self.emit_removed(dropped)

    def emit_removed(self, blocks: list[HostBlock]) -> None:
        """BlockRemoved (CPU) events for blocks that left the host tier, one per namespace run."""
        if not self.events.callbacks:
            return
        for namespace, run in groupby(blocks, key=lambda block: block[1]):
            self.events.emit(BlockRemoved([digest for digest, _ in run], namespace, CPU))

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
