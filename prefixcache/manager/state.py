"""The state of one cache manager, shared by the helpers that work on it, and the state of each
live request.

``CacheState`` is the whole of what a manager knows and owns: its settings, the radix index, the
block pool, the evictor, the tiers below the GPU (the host tier's ``HostOffload``, a store's
``StoreTier``), the live requests, pins, the step's held copy sources, the counters, the event
listeners and the clock. The manager builds it once and hands the same object to every helper,
for the manager's whole life: ``reset`` clears it in place (``clear``), keeping what outlives a
reset (settings, counters, listeners, clock, shares, the tiers' slots and connections).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType

from prefixcache.blocks.eviction import Evictor, PolicyKey
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.host_tier import HostTier
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.pool import BlockPool
from prefixcache.blocks.radix import Node, RadixIndex
from prefixcache.manager.listeners import Listeners
from prefixcache.manager.lower_tiers.host_offload import HostOffload
from prefixcache.manager.lower_tiers.store_tier import BlockPresence, StoreTier
from prefixcache.manager.lower_tiers.transfers import StoreWrite, TransferModel, Transfers
from prefixcache.manager.stats import BlockCounts, CacheStats
from prefixcache.manager.tenant_shares import (
    LOST_LIMIT_FACTOR,
    ShareEvictor,
    TenantLedger,
    TenantShare,
    TenantStats,
    share_evictor_for,
    tenant_rows,
)


class RequestState:
    """A request's private state. It holds the index path from the root down to ``deepest``."""

    __slots__ = (
        "blocked",
        "claim",
        "copy_source",
        "deepest",
        "dependents",
        "namespace",
        "num_tokens",
        "pending",
        "pending_start",
        "private",
        "request_id",
        "table",
        "tokens",
        "unconfirmed",
    )

    def __init__(
        self,
        request_id: Hashable,
        namespace: Namespace,
        tokens: bytes | bytearray,
        num_tokens: int,
        table: list[int],
        deepest: Node | None,
    ) -> None:
        self.request_id = request_id
        self.namespace = namespace
        self.tokens = tokens  # int32 LE token ids (bytes until the first append)
        self.num_tokens = num_tokens
        self.table = table  # block table
        self.private: list[int] = []  # table blocks that are not on the index path
        self.deepest = deepest  # None: holds no indexed block
        self.blocked = False  # a digest collision stopped committing this sequence
        self.copy_source: Node | None = None  # held until its partial copy has surely run
        self.claim: tuple[int, float] | None = None  # (priority, retain until) of its blocks
        self.unconfirmed = False  # wrote K/V that no end_step or release has confirmed yet
        # blocks it entered into the index, not yet confirmed (a list once there are any)
        self.pending: list[int] | tuple[()] = ()
        self.pending_start: int | None = None  # block position of the first of them
        # forks taken while it was unconfirmed (a list once there are any)
        self.dependents: list[RequestState] | tuple[()] = ()

    def confirm(self) -> None:
        """Its K/V is written: nothing of it is pending and nothing depends on its writes."""
        self.unconfirmed = False
        self.pending = ()
        self.pending_start = None
        self.dependents = ()


class TickClock:
    """The manager's clock when the runtime gives none: it advances one tick per reading."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0.0

    def tick(self) -> float:
        """The next tick (the bound method is the clock: cheaper to call than an instance)."""
        self.ticks += 1.0
        return self.ticks


class CacheState:
    """One manager's state, read and changed by its helpers, which keep a reference to it and
    read its parts through it: ``clear`` replaces the index and ``apply_shares`` the eviction
    order and the tenant counters, so a helper never holds a part that may be replaced."""

    __slots__ = (
        "block_size",
        "claims_all",
        "enable_caching",
        "evictor",
        "hasher",
        "holds",
        "host",
        "index",
        "listeners",
        "now",
        "num_blocks",
        "offload",
        "partial_copy",
        "pins",
        "pool",
        "refs",
        "seqs",
        "stats",
        "stepped",
        "store",
        "tenants",
        "ticks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_algo: str,
        policy: str | PolicyKey,
        clock: Callable[[], float] | None,
        partial_copy: bool,
        enable_caching: bool,
        stepped: bool,
        shares: Mapping[str, TenantShare] | None,
        host_blocks: int,
        transfer_model: TransferModel | None,
        store: BlockPresence | None,
        store_transfer_model: TransferModel | None,
    ) -> None:
        """A manager's first state, empty, with its tiers (settings checked by the caller;
        ``shares``: None for no tenant accounting, ``host_blocks`` 0 and ``store`` None for no
        host tier and no store)."""
        self.hasher = hasher = BlockHasher(block_size, hash_algo)
        self.block_size = block_size  # tokens per block: the one setting every part reads
        self.num_blocks = num_blocks
        self.partial_copy = partial_copy
        self.enable_caching = enable_caching
        self.stepped = stepped
        # under the priority policy a default request's claim (0, forever) counts too: it lifts a
        # lower priority left by another request on the blocks it shares
        self.claims_all = policy == "priority"
        self.ticks = ticks = TickClock()  # the clock when none is given
        self.now = ticks.tick if clock is None else clock
        self.stats = stats = CacheStats()  # the counters and listeners outlive a reset
        self.listeners = listeners = Listeners()
        self.pool = BlockPool(num_blocks)
        self.index = index = RadixIndex(hasher)  # a new one after each reset
        # per-tenant eviction counters: None unless tenant shares (or accounting) are on
        self.tenants: TenantLedger | None = None
        if shares is None:
            self.evictor: Evictor = Evictor(policy)
        else:  # the shares' eviction order counts the index's tenants
            self.evictor = ShareEvictor(policy, shares, index.tenant_blocks)
            self.tenants = TenantLedger(LOST_LIMIT_FACTOR * num_blocks)
        self.host: HostTier | None = None  # the host tier: its nodes live in the index
        self.offload: HostOffload | None = None  # its offloads and loads
        if host_blocks:
            self.host = HostTier(host_blocks, index)
            self.offload = HostOffload(self.host, hasher, stats, listeners, transfer_model)
        self.store: StoreTier | None = None  # a shared K/V store below the host tier
        if store is not None:
            self.store = StoreTier(hasher, stats, store, store_transfer_model)
        self.seqs: dict[Hashable, RequestState] = {}  # the live requests, in admission order
        self.pins: dict[int, Node] = {}  # pin handle -> the deepest pinned node
        # stepped: copy sources of the current step that their request let go of before its end
        self.holds: list[tuple[Node, RequestState]] = []  # partial-copy source nodes
        self.refs: list[int] = []  # private blocks a copy-on-write of the step reads

    def clear(self) -> None:
        """A reset: no request, pin, cached or host block, planned transfer or write; the
        settings, counters, listeners, clock and shares stay. The index is a new one."""
        if self.offload is not None:
            self.offload.clear()
        if self.store is not None:
            self.store.clear()
        self.pool.reset()
        self.evictor.clear()
        self.index = index = RadixIndex(self.hasher)
        if self.host is not None:  # its nodes live in the state's index
            self.host.index = index
        if isinstance(self.evictor, ShareEvictor):  # it counts the tenants of the index
            self.evictor.counts = index.tenant_blocks
        if self.tenants is not None:  # what was evicted before the reset is not missed
            self.tenants.forget_lost()
        self.seqs.clear()
        self.pins.clear()
        self.holds.clear()
        self.refs.clear()

    # ---- the tiers below the GPU, for the manager's calls ---------------------------------
    def expire_store_writes(self) -> None:
        """A call that may hand blocks out again: the store's write-throughs not taken by now
        are dropped (and counted)."""
        if self.store is not None:
            self.store.expire()

    def forget_store_writes(self, request_ids: list[Hashable]) -> None:
        """Requests taken out before their K/V was written: nothing of theirs is written."""
        if self.store is not None:
            self.store.forget(request_ids)

    def end_tiers_step(self) -> None:
        """The step's K/V is written: the host slots its loads read are free, and its
        write-throughs are ready."""
        if self.offload is not None:
            self.offload.end_step()
        if self.store is not None:
            self.store.end_step()

    def take_transfers(self) -> Transfers:
        """The host-tier and store transfers planned since the last call, which are forgotten."""
        store_loads = self.store.take_loads() if self.store is not None else []
        if self.offload is None:
            return Transfers([], [], store_loads)
        host = self.offload.take_transfers()
        return Transfers(host.offloads, host.loads, store_loads)

    def take_store_writes(self) -> list[StoreWrite]:
        """The ended step's write-throughs (each digest once), which are forgotten."""
        return self.store.take_writes() if self.store is not None else []

    # ---- tenant shares --------------------------------------------------------------------
    def shares(self) -> dict[str, TenantShare] | None:
        """The tenant shares in force ({}: per-tenant counts only; None: no accounting)."""
        evictor = self.evictor
        return evictor.shares if isinstance(evictor, ShareEvictor) else None

    def apply_shares(self, shares: dict[str, TenantShare] | None) -> None:
        """Put ``shares`` (checked; None: no tenant accounting) in force: a new eviction order
        with every evictable leaf filed in it (O(cached nodes)); the counters carry on."""
        evictor = share_evictor_for(self.evictor, shares, self.index.tenant_blocks)
        now = self.now()
        for node in self.index.iter_nodes():
            if evictor.evictable(node):
                evictor.push(node, now)
        self.evictor = evictor
        if shares is None:
            self.tenants = None
        elif self.tenants is None:
            self.tenants = TenantLedger(LOST_LIMIT_FACTOR * self.num_blocks)

    def tenant_stats(self) -> dict[str | None, TenantStats]:
        """Per tenant: cached blocks, its share and its eviction counters ({}: no accounting)."""
        if self.tenants is None:
            return {}
        return tenant_rows(self.index.tenant_blocks, self.shares() or {}, self.tenants)

    def block_counts(self) -> BlockCounts:
        """Free, active (held by requests, pins or the step) and cached (evictable) blocks."""
        pool, index = self.pool, self.index
        active = index.active_blocks + pool.num_private
        return BlockCounts(pool.num_free, active, index.num_blocks - index.active_blocks)

    def pending_blocks(self) -> frozenset[int]:
        """Indexed blocks whose K/V no ``end_step`` or ``release`` has confirmed yet."""
        return frozenset(b for seq in self.seqs.values() for b in seq.pending)


class ManagerInternals:
    """A read-only look inside a manager (``CacheManager.internals``), for integrity checks,
    tests and tools; never needed to drive one. Each figure is read when asked for."""

    __slots__ = ("_state",)

    def __init__(self, state: CacheState) -> None:
        self._state = state

    @property
    def radix_index(self) -> RadixIndex:
        """The radix index of cached blocks (``reset`` replaces it)."""
        return self._state.index

    @property
    def pool(self) -> BlockPool:
        """The physical block pool: its free blocks, and the refcounts of the private ones."""
        return self._state.pool

    @property
    def states(self) -> Mapping[Hashable, RequestState]:
        """Every live request's state, by request id."""
        return MappingProxyType(self._state.seqs)

    @property
    def pins(self) -> Mapping[int, Node]:
        """The active pins: handle -> the deepest pinned node."""
        return MappingProxyType(self._state.pins)

    @property
    def pending_blocks(self) -> frozenset[int]:
        """Indexed blocks whose K/V no ``end_step`` or ``release`` has confirmed yet."""
        return self._state.pending_blocks()

    @property
    def step_holds(self) -> tuple[list[Node], list[int]]:
        """Copy sources held until ``end_step`` (stepped): index nodes and private blocks."""
        state = self._state
        return [node for node, _ in state.holds], list(state.refs)

    @property
    def clock_ticks(self) -> float:
        """The internal clock's reading (it advances once per event when no ``clock`` is
        given)."""
        return self._state.ticks.ticks

    @property
    def listener_errors(self) -> int:
        """Exceptions raised by listeners (logged, then ignored)."""
        return self._state.listeners.errors
