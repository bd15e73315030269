"""The runtime's view of the cache: admit, append, fork and release requests over shared blocks.

Every public call validates its input and checks capacity before touching any state, so a
rejected call raises a typed error and changes nothing.

The step protocol (pending blocks, abort, copy sources held through a step) is described once,
in docs/architecture.md ("The step protocol"); each operation's docstring says its part.

All it knows is one ``CacheState`` (state.py), which builds and owns every part, the tiers
below the GPU included, for the manager's whole life (``reset`` clears it in place). The helpers
built around it once each keep that state, read its parts through it and do one job: planning
(admission_planning), block tables (request_blocks), indexing (block_indexing), allocation and
eviction (block_supply) and the step ledger (step_ledger); the tiers are the state's
(lower_tiers/). Introspection (tests, tools, the integrity check) goes through one accessor,
``internals``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from prefixcache.blocks.eviction import Evictor, PolicyKey
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.host_tier import HostTier
from prefixcache.blocks.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.blocks.pool import BlockPool
from prefixcache.blocks.radix import RadixIndex
from prefixcache.blocks.tokens import (
    TokenIds,
    as_single_token,
    as_size,
    as_token_array,
    as_token_bytes,
)
from prefixcache.errors import (
    CacheInUseError,
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownRequestError,
)
from prefixcache.manager.admission_planning import AdmissionPlanner
from prefixcache.manager.argument_checks import (
    check_force,
    check_namespace,
    check_pad,
    check_policy,
    check_priority,
    check_prompt_digests,
    check_settings,
    check_store,
    check_transfer_model,
    is_live,
    live_request,
    request_id_list,
    torch_device,
)
from prefixcache.manager.block_events import AllBlocksCleared, EventListener
from prefixcache.manager.block_indexing import BlockIndexer
from prefixcache.manager.block_supply import BlockSupply
from prefixcache.manager.integrity import check_state
from prefixcache.manager.lower_tiers.store_tier import BlockPresence
from prefixcache.manager.lower_tiers.transfers import StoreWrite, TransferModel, Transfers
from prefixcache.manager.request_blocks import RequestBlocks, TokenAppender
from prefixcache.manager.results import Admission, AppendResult, Lookup
from prefixcache.manager.state import CacheState, ManagerInternals, RequestState
from prefixcache.manager.stats import BlockCounts, CacheStats
from prefixcache.manager.step_ledger import StepLedger
from prefixcache.manager.tenant_shares import TenantShare, TenantStats, check_shares

__all__ = ["CacheManager", "ManagerInternals", "RequestState"]


class CacheManager:
    """Prefix-cached paged block manager for one pool of ``num_blocks`` physical blocks.

    ``stepped=True``: the runtime calls ``end_step()`` after every forward pass, and the source of
    every copy handed out in a step stays held until then (see the module docstring).

    ``host_blocks=N`` adds a host-memory tier of ``N`` block slots, exclusive of the GPU index:
    evicted blocks are offloaded to it, and an admission loads the host blocks that continue its
    cached prefix (``take_transfers()`` hands out the copies to run; see docs/architecture.md).
    ``transfer_model`` decides per admission whether loading beats recomputing (None: always
    load).

    ``store`` (a ``BlockPresence``: a store connector) adds a shared K/V store below the host
    tier: an admission loads the stored blocks that continue its cached prefix and writes the
    full blocks it computes through after its step (``take_transfers``, ``take_store_writes``;
    docs/tiers.md). ``store_transfer_model`` prices its loads against recomputing. Needs
    ``stepped=True``.

    ``shares`` maps tenants (cache salts) to ``TenantShare(guaranteed, cap)`` in blocks: other
    tenants' allocations leave a tenant its guarantee, and a tenant at its cap evicts its own
    blocks before it grows (tenant_shares.py). ``{}`` counts per tenant without any share;
    None (the default) keeps no tenant accounting. ``set_shares`` changes them at run time.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        hash_algo: str = "xxh3_128",
        policy: str | PolicyKey = "lru",
        partial_copy: bool = True,
        enable_caching: bool = True,
        stepped: bool = False,
        clock: Callable[[], float] | None = None,
        host_blocks: int = 0,
        transfer_model: TransferModel | None = None,
        shares: Mapping[str, TenantShare] | None = None,
        store: BlockPresence | None = None,
        store_transfer_model: TransferModel | None = None,
    ) -> None:
        blocks = as_size(num_blocks, "num_blocks", 1)
        checked = None if shares is None else check_shares(shares, blocks)
        size = as_size(block_size, "block_size", 1)
        num_host = as_size(host_blocks, "host_blocks")
        check_policy(policy)
        check_settings(hash_algo, partial_copy, enable_caching, stepped, clock)
        if num_host and not enable_caching:
            raise ConfigError("a host tier (host_blocks > 0) needs enable_caching=True")
        if transfer_model is not None:
            check_transfer_model(transfer_model)
        if store is not None:
            check_store(store, store_transfer_model, stepped, enable_caching)
        self._state = state = CacheState(
            blocks,
            size,
            hash_algo=hash_algo,
            policy=policy,
            clock=clock,
            partial_copy=bool(partial_copy),
            enable_caching=bool(enable_caching),
            stepped=bool(stepped),
            shares=checked,
            host_blocks=num_host,
            transfer_model=transfer_model,
            store=store,
            store_transfer_model=store_transfer_model,
        )
        self.transfer_model = transfer_model
        self._pin_ids = itertools.count(1)  # handles stay unique across resets
        self._supply = supply = BlockSupply(state)
        self._planner = AdmissionPlanner(state)
        self._ledger = ledger = StepLedger(state, supply)
        self._requests = RequestBlocks(state, supply, BlockIndexer(state), ledger)
        self._seqs = state.seqs  # the live requests (cleared in place): every call looks one up
        self._appender = TokenAppender(self._requests)

    # ---- settings and components ----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._state.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._state.block_size

    @property
    def hasher(self) -> BlockHasher:
        """How blocks are named: the hash algorithm, chained over tokens, position, namespace."""
        return self._state.hasher

    @property
    def stats(self) -> CacheStats:
        """The counters (they survive ``reset``)."""
        return self._state.stats

    @property
    def partial_copy(self) -> bool:
        """Whether a block whose leading tokens match is copied rather than recomputed."""
        return self._state.partial_copy

    @property
    def enable_caching(self) -> bool:
        """Whether full blocks are indexed and reused (False: the no-cache baseline)."""
        return self._state.enable_caching

    @property
    def stepped(self) -> bool:
        """Whether the runtime calls ``end_step()`` after each forward pass (copy sources are
        then held until it does)."""
        return self._state.stepped

    @property
    def index(self) -> RadixIndex:
        """The radix index of cached blocks (a new one after ``reset``)."""
        return self._state.index

    @property
    def pool(self) -> BlockPool:
        """The physical blocks: the free list and the refcounts of private blocks."""
        return self._state.pool

    @property
    def evictor(self) -> Evictor:
        """The eviction order: evictable leaves keyed by the policy."""
        return self._state.evictor

    @property
    def host(self) -> HostTier | None:
        """The host tier, when ``host_blocks`` gave one."""
        return self._state.host

    @property
    def internals(self) -> ManagerInternals:
        """A read-only look at the state: live requests, pins, pending blocks, the step's held
        copy sources, the clock and listener errors."""
        return ManagerInternals(self._state)

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> Lookup:
        """How much of ``tokens`` an admission would not compute, changing nothing (routing,
        planning). Counts a partially matching block's copied tokens, as ``admit`` does."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        plan = self._planner.plan(arr.tobytes(), namespace, check_size=False)
        cached_blocks = plan.match.n if plan.match is not None else 0
        return Lookup(plan.cached_len, cached_blocks, len(plan.host_run))

    def can_admit(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> bool:
        """Whether ``admit`` would succeed now (free plus evictable blocks suffice). False too
        for a prompt that can never fit; ``admit`` says why."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        state = self._state
        if -(-len(arr) // state.block_size) > state.num_blocks:
            return False
        plan = self._planner.plan(arr.tobytes(), namespace)
        return plan.need <= self._supply.available(plan.held_cached)

    def admit(
        self,
        request_id: Hashable,
        tokens: TokenIds,
        namespace: Namespace = DEFAULT_NAMESPACE,
        *,
        priority: int = 0,
        retention: float | None = None,
        digests: Sequence[bytes] | None = None,
    ) -> Admission:
        """Admit a prompt: reuse its longest cached prefix, allocate the rest, index its full
        blocks (so requests of the same step share them at once) and return its block table.

        ``priority`` (with ``retention`` time units, default forever) orders eviction under the
        ``priority`` policy: lower goes first. ``digests``: the prompt's full-block digests, when
        the caller hashed it already (``hasher.hash_prompt(tokens, namespace)``, as a router
        does): they are not computed again, and are trusted to be those.
        """
        if is_live(self._seqs, request_id):
            raise DuplicateRequestError(f"request {request_id!r} is already admitted")
        buf = as_token_bytes(tokens)
        if type(namespace) is not Namespace:
            check_namespace(namespace)
        if type(priority) is not int or retention is not None:
            priority, retention = check_priority(priority, retention)
        known = None
        if digests is not None:
            known = check_prompt_digests(digests, len(buf) // 4 // self._state.block_size)
        self._state.expire_store_writes()
        plan = self._planner.plan(buf, namespace, digests=known)
        available = self._supply.available(plan.held_cached)
        if plan.need > available:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {plan.need} new blocks but only {available} are "
                "free or evictable; release requests first",
                needed=plan.need,
                available=available,
            )
        return self._requests.admit(request_id, namespace, buf, plan, priority, retention, known)

    # ---- decode ---------------------------------------------------------------------------
    def can_append(self, request_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append`` of ``num_tokens`` tokens would find the blocks it needs now."""
        seq = live_request(self._seqs, request_id)
        k = as_size(num_tokens, "num_tokens")
        return self._requests.append_need(seq, k) <= self._supply.available(0)

    def append(
        self, request_id: Hashable, tokens: TokenIds | int, *, map_slots: bool = True
    ) -> AppendResult:
        """Append generated tokens (one int, numpy or 0-d tensor scalar, or any token
        container); allocates blocks as needed and copies a shared partial last block before
        writing into it. Newly filled blocks enter the index. ``map_slots=False``: the result's
        ``slots`` is empty, for a caller that maps slots from the block table itself (or
        writes no K/V, as a simulation)."""
        seq = live_request(self._seqs, request_id)
        self._state.expire_store_writes()
        token = as_single_token(tokens)
        if token is not None:  # the decode fast path: no array round trip for one token
            data, k = token.to_bytes(4, "little"), 1
        else:
            data = as_token_bytes(tokens)
            k = len(data) // 4
        return self._requests.append(seq, data, k, map_slots)

    def appender(self) -> TokenAppender:
        """``append`` for a decode loop that keeps its tokens as int32 LE bytes: the returned
        callable ``appender(request_id, data)`` does what ``append(request_id, data,
        map_slots=False)`` does (same checks, blocks, copies and errors; ``slots`` empty), in the
        compiled core from end to end, where the per-call cost of ``append`` is mostly its
        argument handling. Take it once; it serves this manager for good."""
        return self._appender

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks, the partial last
        one too (parallel sampling, beam search). Writes copy on demand."""
        parent = live_request(self._seqs, parent_id)
        if is_live(self._seqs, child_id):
            raise DuplicateRequestError(f"request {child_id!r} is already admitted")
        self._requests.fork(parent, child_id)

    def release(self, request_id: Hashable) -> None:
        """Finish a request whose K/V has been written. Its indexed blocks stay cached
        (evictable); private ones are freed. Use ``abort`` when its K/V was never written."""
        seq = live_request(self._seqs, request_id)
        del self._seqs[request_id]  # what it wrote is confirmed: nothing of it stays pending
        self._supply.release_request(seq)

    def abort(self, request_id: Hashable) -> list[Hashable]:
        """Drop a request before the forward pass wrote its K/V (preempted while the step is
        planned, a client gone before its prefill).

        The blocks it entered into the index since its K/V was last confirmed leave the index,
        and every live request that relies on them (a hit on them, a partial copy from them, a
        fork taken before they were written) is dropped too. Returns the ids dropped, this one
        first; requeue them all, and take their slots and copies out of the step's batch: their
        blocks may be handed out again at once (preemption makes room in the same step).
        """
        dropped = self._ledger.abort(live_request(self._seqs, request_id))
        self._state.forget_store_writes(dropped)
        return dropped

    def abort_many(self, request_ids: Iterable[Hashable]) -> list[Hashable]:
        """``abort`` each of ``request_ids`` that an earlier one's abort did not drop already (a
        request relying on another's unwritten blocks goes with it), e.g. the requests whose
        store loads failed in one step. Returns every id dropped, each once. An id that was
        not admitted when called raises UnknownRequestError, and nothing is aborted."""
        ids = list(request_ids)
        for request_id in ids:
            live_request(self._seqs, request_id)
        dropped: list[Hashable] = []
        for request_id in ids:
            if is_live(self._seqs, request_id):
                dropped += self.abort(request_id)
        return dropped

    def end_step(self) -> None:
        """The forward pass of the step has written every K/V it was given: pending blocks
        become ordinary cached blocks, and the copy sources held for the step are let go."""
        self._ledger.end_step()
        self._state.end_tiers_step()

    def take_transfers(self) -> Transfers:
        """The host-tier and store transfers planned since the last call, and forget them.
        Run every offload, then every load, after planning the step and before its forward
        pass. A store load that fails: ``abort`` its request (and requeue what that drops)."""
        return self._state.take_transfers()

    def take_store_writes(self) -> list[StoreWrite]:
        """The full prompt blocks computed by the step that just ended, to write through to
        the store (each digest once). Call right after ``end_step()`` and copy the blocks out
        before the next ``admit`` or ``append``, which may hand them out again (writes not
        taken by then are dropped and counted in ``stats.store_writes_expired``)."""
        return self._state.take_store_writes()

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks now (policy order); returns how many."""
        count = min(as_size(num_blocks, "num_blocks"), self._supply.evictable())
        self._state.expire_store_writes()
        if count:
            self._supply.evict(count, asked=True)
        return count

    # ---- tenant shares ---------------------------------------------------------------------
    @property
    def shares(self) -> Mapping[str, TenantShare] | None:
        """The tenant shares in force ({}: per-tenant counts only; None: no tenant accounting)."""
        found = self._state.shares()
        return None if found is None else MappingProxyType(found)

    def set_shares(self, shares: Mapping[str, TenantShare] | None) -> None:
        """Replace every tenant share (None: stop tenant accounting). Checked first, so a bad
        mapping changes nothing; refiles the evictable leaves in O(cached nodes)."""
        state = self._state
        state.apply_shares(None if shares is None else check_shares(shares, state.num_blocks))

    def tenant_stats(self) -> dict[str | None, TenantStats]:
        """Per tenant (cache salt; None: no salt): cached blocks, its share, and evictions (by
        others, at its cap, under its guarantee). Empty without tenant accounting."""
        return self._state.tenant_stats()

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """Keep the cached prefix of ``tokens`` from eviction (system prompts, attention sinks).

        Returns ``(handle, pinned_tokens)``; only what is cached and written now is pinned.
        """
        arr = as_token_array(tokens)
        check_namespace(namespace)
        state = self._state
        index = state.index
        root = index.roots.get(namespace)
        if root is None:
            return 0, 0
        buf = arr.tobytes()
        match = index.match(root, buf, len(arr) // state.block_size)
        pending = state.pending_blocks()
        if pending and match.n:  # stop before the first block whose K/V is not written yet
            blocks = index.path_blocks(match.node)[: match.n]
            written = next((i for i, b in enumerate(blocks) if b in pending), None)
            if written is not None:
                match = index.match(root, buf, written)
        if match.n == 0:
            return 0, 0
        node = match.node
        if match.j < len(node.blocks):
            node = index.split(node, match.j)
        index.hold(node, state.now())
        handle = next(self._pin_ids)
        state.pins[handle] = node
        return handle, match.n * state.block_size

    def unpin(self, handle: int) -> None:
        """Let a pinned prefix be evicted again (``handle`` from ``pin``; 0: pinned nothing)."""
        if type(handle) is not int:
            raise InvalidArgumentError(f"a pin handle is an int from pin(), got {handle!r}")
        if handle == 0:
            return
        node = self._state.pins.pop(handle, None)
        if node is None:
            raise UnknownRequestError(f"pin handle {handle!r} is not active")
        self._supply.unhold(node)

    # ---- views ----------------------------------------------------------------------------
    def block_table(self, request_id: Hashable) -> list[int]:
        """A copy of the request's block table."""
        return list(live_request(self._seqs, request_id).table)

    def num_tokens(self, request_id: Hashable) -> int:
        """The request's tokens so far (prompt and appended)."""
        return live_request(self._seqs, request_id).num_tokens

    def token_ids(self, request_id: Hashable) -> np.ndarray:
        """A copy of the request's token ids (int32)."""
        return np.frombuffer(bytes(live_request(self._seqs, request_id).tokens), dtype="<i4")

    def block_tables(
        self, request_ids: Iterable[Hashable], device: Any = "cpu", pad: int = -1
    ) -> Any:
        """Block tables as an int32 torch tensor ``[batch, max_blocks]`` on ``device``."""
        import torch

        check_pad(pad)
        dev = torch_device(device)
        tables = [live_request(self._seqs, r).table for r in request_id_list(request_ids)]
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        width = int(lens.max()) if len(tables) else 0
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
        out = np.full((len(tables), width), pad, dtype=np.int32)
        out[np.arange(width) < lens[:, None]] = flat  # row-major fill of each row's prefix
        return torch.from_numpy(out).to(dev)

    @property
    def requests(self) -> list[Hashable]:
        """The live requests' ids, in admission order."""
        return list(self._seqs)

    def block_counts(self) -> BlockCounts:
        """Free, active (held by requests, pins or the step) and cached (evictable) blocks."""
        return self._state.block_counts()

    # ---- events ---------------------------------------------------------------------------
    def add_listener(self, listener: EventListener, *, token_ids: bool = True) -> None:
        """Call ``listener`` with BlockStored / BlockRemoved / AllBlocksCleared events.

        Events are emitted in the middle of an operation, so a listener that raises cannot stop
        it: the error is logged and counted in ``listener_errors``, and the operation completes
        (the cache stays consistent; that listener misses the event).

        ``token_ids=False``: the listener reads digests only (an index fed in the same
        process); while no listener reads token ids, BlockStored events carry none
        (``token_ids == []``) and no list of ints is built for them."""
        if not callable(listener):
            raise InvalidArgumentError(
                f"a listener must be a callable (it is called with each event), got {listener!r}"
            )
        if type(token_ids) is not bool:
            raise InvalidArgumentError(f"token_ids must be a bool, got {token_ids!r}")
        self._state.listeners.add(listener, token_ids)

    def remove_listener(self, listener: EventListener) -> None:
        """Stop calling ``listener`` (InvalidArgumentError when it was not added); safe from
        inside a listener or another thread: an event being sent still reaches the others."""
        try:
            self._state.listeners.remove(listener)
        except ValueError:
            raise InvalidArgumentError(f"{listener!r} is not a listener of this manager") from None

    # ---- lifecycle ------------------------------------------------------------------------
    def reset(self, *, force: bool = False) -> None:
        """Drop every cached block. Refuses while requests or pins hold blocks unless forced;
        a forced reset also drops every request and pin."""
        check_force(force)
        in_use = self.block_counts().active
        if in_use and not force:
            held = self._ledger.num_holds()
            step = f" and {held} holds of this step (end_step() ends them)" if held else ""
            raise CacheInUseError(
                f"{in_use} blocks are in use by {len(self._seqs)} requests and "
                f"{len(self._state.pins)} pins{step}; release them first or pass force=True"
            )
        self._state.clear()
        self._state.listeners.emit(AllBlocksCleared())

    def check_integrity(self) -> None:
        """Assert every invariant the bookkeeping can see (docs/architecture.md). O(cache)."""
        check_state(self._state)
