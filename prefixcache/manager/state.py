"""The state of one cache manager, shared by the helpers that work on it, and the state of each
live request.

``CacheState`` is the whole of what a manager knows: its settings, the radix index, the block
pool, the evictor, the host tier, the live requests, pins, the step's held copy sources, the
counters, the event listeners (``Listeners``) and the clock. The manager builds it once
(``CacheState.build``) and hands the same object to every helper; ``reset`` builds the next one
with ``emptied``, which keeps what outlives a reset (settings, counters, listeners, clock, the
host tier's slots) and starts every structure of blocks afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from prefixcache.blocks.eviction import Evictor, PolicyKey
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.host_tier import HostTier
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.pool import BlockPool
from prefixcache.blocks.radix import Node, RadixIndex
from prefixcache.manager.block_events import CacheEvent, EventListener
from prefixcache.manager.stats import CacheStats
from prefixcache.manager.tenant_shares import (
    LOST_LIMIT_FACTOR,
    ShareEvictor,
    TenantLedger,
    TenantShare,
    TenantStats,
    share_evictor_for,
    tenant_rows,
)

if TYPE_CHECKING:
    from prefixcache.manager.lower_tiers.host_offload import HostOffload
    from prefixcache.manager.lower_tiers.store_tier import StoreTier

log = logging.getLogger("prefixcache.manager")


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


class Listeners:
    """The callables that receive the manager's BlockStored / BlockRemoved / AllBlocksCleared
    events. ``callbacks`` is replaced, never changed in place, so an event being sent keeps the
    list it started with; an empty list means no event needs building."""

    __slots__ = ("callbacks", "errors")

    def __init__(self) -> None:
        self.callbacks: list[EventListener] = []
        self.errors = 0  # exceptions raised by listeners (logged, then ignored)

    def add(self, listener: EventListener) -> None:
        """Call ``listener`` with every later event."""
        self.callbacks = [*self.callbacks, listener]

    def remove(self, listener: EventListener) -> None:
        """Stop calling ``listener``; ValueError when it was not added."""
        callbacks = list(self.callbacks)
        callbacks.remove(listener)
        self.callbacks = callbacks

    def emit(self, event: CacheEvent) -> None:
        """Send ``event`` to every listener. Events go out in the middle of an operation, so an
        exception from a listener is logged and counted, never raised."""
        for listener in self.callbacks:
            try:
                listener(event)
            except Exception:  # mid-operation: raising here would leave the state half-changed
                self.errors += 1
                log.exception("event listener %r failed on %s", listener, type(event).__name__)


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
    """One manager's state, read and changed by its helpers (each keeps a reference)."""

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
        hasher: BlockHasher,
        pool: BlockPool,
        evictor: Evictor,
        host: HostTier | None,
        stats: CacheStats,
        listeners: Listeners,
        ticks: TickClock,
        now: Callable[[], float],
        *,
        partial_copy: bool,
        enable_caching: bool,
        stepped: bool,
        claims_all: bool,
    ) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size  # tokens per block: the one setting every part reads
        self.index = RadixIndex(hasher)
        self.pool = pool
        self.num_blocks = pool.num_blocks
        self.evictor = evictor
        self.host = host  # None: no host tier
        if host is not None:
            host.index = self.index  # its nodes live in the index
        self.offload: HostOffload | None = None  # set by the manager when there is a host tier
        self.store: StoreTier | None = None  # set by the manager when there is a shared store
        self.stats = stats
        self.listeners = listeners
        self.ticks = ticks  # the clock when none is given
        self.now = now
        self.partial_copy = partial_copy
        self.enable_caching = enable_caching
        self.stepped = stepped
        # under the priority policy a default request's claim (0, forever) counts too: it lifts a
        # lower priority left by another request on the blocks it shares
        self.claims_all = claims_all
        self.seqs: dict[Hashable, RequestState] = {}  # the live requests, in admission order
        self.pins: dict[int, Node] = {}  # pin handle -> the deepest pinned node
        # stepped: copy sources of the current step that their request let go of before its end
        self.holds: list[tuple[Node, RequestState]] = []  # partial-copy source nodes
        self.refs: list[int] = []  # private blocks a copy-on-write of the step reads
        # per-tenant eviction counters: None unless tenant shares (or accounting) are on
        self.tenants: TenantLedger | None = None
        if isinstance(evictor, ShareEvictor):  # it counts the tenants of this state's index
            evictor.counts = self.index.tenant_blocks

    def pending_blocks(self) -> frozenset[int]:
        """Indexed blocks whose K/V no ``end_step`` or ``release`` has confirmed yet."""
        return frozenset(b for seq in self.seqs.values() for b in seq.pending)

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

    @classmethod
    def build(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        hash_algo: str,
        policy: str | PolicyKey,
        host_blocks: int,
        clock: Callable[[], float] | None,
        partial_copy: bool,
        enable_caching: bool,
        stepped: bool,
        shares: Mapping[str, TenantShare] | None = None,
    ) -> CacheState:
        """A manager's first state: empty, its sizes and shares checked by the caller
        (``shares``: None for no tenant accounting)."""
        hasher = BlockHasher(block_size, hash_algo)
        ticks = TickClock()
        evictor = Evictor(policy) if shares is None else ShareEvictor(policy, shares, {})
        state = cls(
            hasher,
            BlockPool(num_blocks),
            evictor,
            None,
            CacheStats(),
            Listeners(),
            ticks,
            ticks.tick if clock is None else clock,
            partial_copy=partial_copy,
            enable_caching=enable_caching,
            stepped=stepped,
            claims_all=policy == "priority",  # a default claim (0, forever) counts too
        )
        if host_blocks:  # its nodes live in the state's index
            state.host = HostTier(host_blocks, state.index)
        if shares is not None:
            state.tenants = TenantLedger(LOST_LIMIT_FACTOR * num_blocks)
        return state

    def emptied(self) -> CacheState:
        """The state after a reset: no request, pin, cached or host block, the same settings,
        counters, listeners, clock and host slots."""
        self.pool.reset()
        self.evictor.clear()
        state = CacheState(
            self.hasher,
            self.pool,
            self.evictor,
            self.host,
            self.stats,
            self.listeners,
            self.ticks,
            self.now,
            partial_copy=self.partial_copy,
            enable_caching=self.enable_caching,
            stepped=self.stepped,
            claims_all=self.claims_all,
        )
        state.offload = self.offload
        state.store = self.store
        state.tenants = self.tenants
        if self.tenants is not None:  # what was evicted before the reset is not missed
            self.tenants.forget_lost()
        return state


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
