"""The runtime's view of the cache: admit, append, fork and release requests over shared blocks.

Every public call validates its input and checks capacity before touching any state, so a
rejected call raises a typed error and changes nothing.

The step protocol: a block that ``admit`` or ``append`` enters into the index is *pending* until
its K/V is known to be written: at ``end_step()`` (after the forward pass) or at the writer's
``release``. Requests of the same step may share pending blocks. ``abort`` drops a request whose
K/V was never written: its pending blocks leave the index, and every request that relies on them
(hits on them, copies from them, forks of it) is dropped with it. With ``stepped=True`` the source
of every copy handed out in a step stays held until ``end_step()``, so no block freed during the
step is handed out again while a copy of the step still has to read it. Without steps a
request's blocks are confirmed at its ``release`` (hits and behaviour are what they were before
steps existed); ``abort`` still takes out what it wrote since.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from prefixcache.errors import (
    CacheInUseError,
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownRequestError,
)
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventListener
from prefixcache.eviction import Evictor, PolicyKey
from prefixcache.hashing import DIGEST_SIZE, BlockHasher
from prefixcache.host_tier import HostEntry, HostTier
from prefixcache.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.pool import BlockPool
from prefixcache.radix import MatchResult, Node, PartialMatch, RadixIndex
from prefixcache.results import Admission, AppendResult, Copy, Lookup, slots_of
from prefixcache.stats import BlockCounts, CacheStats
from prefixcache.tokens import TokenIds, as_single_token, as_size, as_token_array
from prefixcache.transfers import Load, Offload, TransferModel, Transfers

log = logging.getLogger(__name__)


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


class _Plan(NamedTuple):
    """An admission sized without changing anything."""

    need: int  # new blocks to take from the pool
    held_cached: int  # matched blocks nobody holds now (an upper bound when capacity is ample)
    match: MatchResult | None  # None: nothing cached in the namespace (or caching is off)
    shared: int  # leading table blocks shared with the index
    cow: bool  # every prompt block matched: the last one is copied and one token recomputed
    partial: PartialMatch | None  # a block whose leading tokens can be copied
    cached_len: int  # prompt tokens not computed (the copied and loaded ones included)
    host_run: list[bytes]  # digests of the host blocks to load after the matched ones
    host_found: int  # host blocks that continue the match (loaded or recomputed)


class CacheManager:
    """Prefix-cached paged block manager for one pool of ``num_blocks`` physical blocks.

    ``stepped=True``: the runtime calls ``end_step()`` after every forward pass, and the source of
    every copy handed out in a step stays held until then (see the module docstring).

    ``host_blocks=N`` adds a host-memory tier of ``N`` block slots, exclusive of the GPU index:
    evicted blocks are offloaded to it, and an admission loads the host blocks that continue its
    cached prefix (``take_transfers()`` hands out the copies to run; see docs/architecture.md).
    ``transfer_model`` decides per admission whether loading beats recomputing (None: always
    load).
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
    ) -> None:
        self.num_blocks = as_size(num_blocks, "num_blocks", 1)
        self.block_size = as_size(block_size, "block_size", 1)
        num_host = as_size(host_blocks, "host_blocks")
        if num_host and not enable_caching:
            raise ConfigError("a host tier (host_blocks > 0) needs enable_caching=True")
        if transfer_model is not None:
            _check_transfer_model(transfer_model)
        self.hasher = BlockHasher(self.block_size, hash_algo)
        self.index = RadixIndex(self.hasher)
        self.pool = BlockPool(self.num_blocks)
        self.evictor = Evictor(policy)
        # under the priority policy a default request's claim (0, forever) counts too: it lifts a
        # lower priority left by another request on the blocks it shares
        self._claims_all = policy == "priority"
        self.partial_copy = partial_copy
        self.enable_caching = enable_caching
        self.stepped = stepped
        self.stats = CacheStats()
        self._clock = clock
        self._tick = 0.0
        self._seqs: dict[Hashable, RequestState] = {}
        self._pins: dict[int, Node] = {}
        self._pin_ids = itertools.count(1)
        self._listeners: list[EventListener] = []
        self.listener_errors = 0  # exceptions raised by listeners (logged, then ignored)
        # stepped: copy sources of the current step that their request let go of before its end
        self._step_holds: list[tuple[Node, RequestState]] = []  # partial-copy source nodes
        self._step_refs: list[int] = []  # private blocks a copy-on-write of the step reads
        self.host: HostTier | None = HostTier(num_host) if num_host else None
        self.transfer_model = transfer_model
        self._offloads: list[Offload] = []  # since the last take_transfers()
        self._loads: list[Load] = []

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> Lookup:
        """How much of ``tokens`` an admission would not compute, changing nothing (routing,
        planning). Counts a partially matching block's copied tokens, as ``admit`` does."""
        arr = as_token_array(tokens)
        _check_namespace(namespace)
        plan = self._plan(arr, arr.tobytes(), namespace, check_size=False)
        n = plan.match.n if plan.match is not None else 0
        return Lookup(plan.cached_len, n, len(plan.host_run))

    def can_admit(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> bool:
        """Whether ``admit`` would succeed now (free plus evictable blocks suffice). False too
        for a prompt that can never fit; ``admit`` says why."""
        arr = as_token_array(tokens)
        _check_namespace(namespace)
        if -(-len(arr) // self.block_size) > self.num_blocks:
            return False
        plan = self._plan(arr, arr.tobytes(), namespace)
        return plan.need <= self._available(plan.held_cached)

    def admit(
        self,
        request_id: Hashable,
        tokens: TokenIds,
        namespace: Namespace = DEFAULT_NAMESPACE,
        *,
        priority: int = 0,
        retention: float | None = None,
    ) -> Admission:
        """Admit a prompt: reuse its longest cached prefix, allocate the rest, index its full
        blocks (so requests of the same step share them at once) and return its block table.

        ``priority`` (with ``retention`` time units, default forever) orders eviction under the
        ``priority`` policy: lower goes first.
        """
        try:
            live = request_id in self._seqs
        except TypeError:
            raise InvalidArgumentError(_UNHASHABLE.format(type(request_id).__name__)) from None
        if live:
            raise DuplicateRequestError(f"request {request_id!r} is already admitted")
        arr = as_token_array(tokens)
        if type(namespace) is not Namespace:
            _check_namespace(namespace)
        if type(priority) is not int or retention is not None:
            _check_priority(priority, retention)
        buf = arr.tobytes()
        plan = self._plan(arr, buf, namespace)
        need, held_cached, match, shared, cow, partial, cached_len, host_run, _ = plan
        if need > self._available(held_cached):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} new blocks but only "
                f"{self._available(held_cached)} are free or evictable; release requests "
                "first"
            )
        # ---- from here on nothing can fail ----
        p, t = self.block_size, len(arr)
        now = self._now()
        n = 0
        node: Node | None = None
        digest = None
        if match is not None:
            node, j, n, digest = match
            if n:
                if j < len(node.blocks):
                    node = self.index.split(node, j)
                self.index.hold(node, now, hit=True)
            else:
                node = digest = None
        if host_run:  # off the host tier before any offload of ours can evict them
            host_slots = self._unload(host_run, namespace)
        if partial is not None:  # the copy source must survive our own eviction (see _plan)
            source = partial[0]
            if len(source.blocks) > 1:  # hold the copied block alone, not the whole run
                source = self.index.split(source, 1)
            self.index.hold(source, now)
            partial = _new(PartialMatch, (source, partial[1]))
        fresh = self._take(need, owned=False)  # what stays private is owned after the commit
        if host_run:
            self._loads += [_new(Load, pair) for pair in zip(host_slots, fresh, strict=False)]
            if not self.stepped:  # the caller runs this call's loads before its next call
                self.host.release_deferred()  # type: ignore[union-attr]
        table = self.index.path_blocks(node)
        src = table[-1] if cow else -1
        del table[shared:]
        table += fresh
        seq = RequestState(request_id, namespace, buf, t, table, node)
        seq.private = fresh  # a new list from the pool: the sequence owns it
        copies: list[Copy] = []
        partial_tokens = 0
        if cow:  # every prompt token is cached: recompute only the last one, in a copy
            if p > 1:  # one-token blocks: nothing to copy, the block is recomputed
                copies.append(Copy(src, fresh[0], p - 1))
                self.stats.cow_copies += 1
        elif partial is not None:
            cand, partial_tokens = partial  # held since before our allocation
            copies.append(Copy(cand.blocks[0], fresh[0], partial_tokens))
            seq.copy_source = cand
            self.stats.partial_copies += 1
            self.stats.partial_copy_tokens += partial_tokens
        seq.unconfirmed = True
        if self.enable_caching:
            self._commit(seq, buf, t // p, digest, now, owned=False)
        self.pool.own(seq.private)  # usually just the partial last block
        if priority or retention is not None or self._claims_all:
            seq.claim = (priority, math.inf if retention is None else now + retention)
            self._set_priority(seq.deepest, *seq.claim, now)
        self._seqs[request_id] = seq
        st = self.stats
        st.requests += 1
        st.lookup_tokens += t
        st.hit_tokens += cached_len
        st.lookup_blocks += t // p
        st.hit_blocks += n + len(host_run)
        st.zero_hit_requests += cached_len == 0
        if plan.host_found:
            st.host_hit_blocks += plan.host_found
            st.loaded_blocks += len(host_run)
        return _new(
            Admission,
            (cached_len, list(table), copies, t, p, n, partial_tokens, cow, len(host_run)),
        )

    def _plan(
        self, arr: np.ndarray, buf: bytes, namespace: Namespace, *, check_size: bool = True
    ) -> _Plan:
        """Match and size an admission without changing anything."""
        p, t = self.block_size, len(arr)
        num_logical = -(-t // p)
        if check_size and num_logical > self.num_blocks:
            raise RequestTooLargeError(
                f"{t} tokens need {num_logical} blocks of {p}, more than the pool's "
                f"{self.num_blocks}; raise num_blocks or split the request"
            )
        root = self.index.roots.get(namespace)
        if root is None or not self.enable_caching:
            if root is None and self.host is not None and self.host.entries:
                on_host, found = self._host_run(buf, t, 0, self.hasher.seed(namespace))
                cached_len = len(on_host) * p
                plan = (num_logical, 0, None, 0, False, None, cached_len, on_host, found)
                return _new(_Plan, plan)
            return _Plan(num_logical, 0, None, 0, False, None, 0, [], 0)
        match = self.index.match(root, buf, t // p)
        host = self.host
        while True:
            node, j, n, digest = match
            cow = n > 0 and n * p == t
            shared = n - 1 if cow else n
            need = num_logical - shared
            partial = None
            run: list[bytes] = []
            found = 0
            if cow:
                cached_len = t - 1
            else:
                if host is not None and host.entries:
                    run, found = self._host_run(buf, t, n, digest)
                cached_len = (n + len(run)) * p
                if self.partial_copy and not run and cached_len < t - 1:
                    partial = self.index.partial_match(match, buf, min(p, t - 1 - cached_len))
                    if partial is not None:
                        cached_len += partial[1]
            cached = self.index.num_blocks - self.index.active_blocks
            free = self.pool.num_free + cached
            # the copy source block is held through the admission (our own allocation must not
            # evict it): unheld, it is one evictable block less meanwhile
            source = 1 if partial is not None and partial[0].ref == 0 else 0
            if need <= free - n - source:  # fits even if every matched block were unheld now
                return _new(_Plan, (need, n, match, shared, cow, partial, cached_len, run, found))
            held_cached = 0
            cur: Node | None = node
            count = j
            while cur is not None and cur.parent is not None:  # matched blocks nobody holds yet
                if cur.ref == 0:
                    held_cached += count
                cur = cur.parent
                count = len(cur.blocks)
            if partial is not None and need > free - held_cached - source:
                cached_len -= partial[1]  # no room to keep the source: recompute those tokens
                partial = None
            if not cow or need <= free - held_cached:
                return _Plan(need, held_cached, match, shared, cow, partial, cached_len, run, found)
            # the copy of the last block needs one block more than the prompt: with the pool
            # that full, recompute the last block instead
            match = self.index.match(root, buf, n - 1)

    def _host_run(self, buf: bytes, t: int, n: int, digest: bytes) -> tuple[list[bytes], int]:
        """The host blocks that continue a match of ``n`` blocks ending at ``digest`` (at most
        ``(t-1)//p`` blocks in all, so one prompt token is computed): the digests to load, and
        how many were found (more than loaded when the transfer model prefers recomputing)."""
        assert self.host is not None
        entries, children = self.host.entries, self.host.children
        bb = self.index.block_bytes
        hash_digest = self.hasher.digest
        end = (t - 1) // self.block_size
        starts = self.hasher.block_starts(end)
        run: list[bytes] = []
        prev = digest
        for i in range(n, end):
            if prev not in children:  # nothing on host continues this chain: no hash needed
                break
            block = buf[i * bb : (i + 1) * bb]
            d = hash_digest(prev + starts[i] + block)
            entry = entries.get(d)
            if entry is None or entry.tokens != block or entry.parent != prev:
                break
            run.append(d)
            prev = d
        found = len(run)
        model = self.transfer_model
        if run and model is not None and not model.should_load(found, self.block_size, n):
            run = []
        return run, found

    def _available(self, held_cached: int) -> int:
        cached = self.index.num_blocks - self.index.active_blocks
        return self.pool.num_free + cached - held_cached

    # ---- decode ---------------------------------------------------------------------------
    def can_append(self, request_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append`` of ``num_tokens`` tokens would find the blocks it needs now."""
        seq = self._seq(request_id)
        k = as_size(num_tokens, "num_tokens")
        return self._append_need(seq, k) <= self._available(0)

    def append(self, request_id: Hashable, tokens: TokenIds | int) -> AppendResult:
        """Append generated tokens (one int, numpy or 0-d tensor scalar, or any token
        container); allocates blocks as needed and copies a shared partial last block before
        writing into it. Newly filled blocks enter the index."""
        seq = self._seq(request_id)
        token = as_single_token(tokens)
        if token is not None:  # the decode fast path: no array round trip for one token
            data, k = token.to_bytes(4, "little"), 1
        else:
            data = as_token_array(tokens).tobytes()
            k = len(data) // 4
        need = self._append_need(seq, k)
        if need > self._available(0):
            raise OutOfBlocksError(
                f"appending {k} tokens to {request_id!r} needs {need} blocks but only "
                f"{self._available(0)} are free or evictable"
            )
        p, t0 = self.block_size, seq.num_tokens
        t1 = t0 + k
        if seq.copy_source is not None:  # the prefill that ran the partial copy is planned
            if self.stepped:  # ... but it runs only in this step's forward pass
                self._step_holds.append((seq.copy_source, seq))
            else:
                self._unhold(seq.copy_source)
            seq.copy_source = None
        fresh = self._take(need)
        copies: list[Copy] = []
        if t0 % p and self.pool.refcount[seq.table[-1]] > 1:  # shared partial block: copy first
            old, dst = seq.table[-1], fresh.pop(0)
            copies.append(Copy(old, dst, t0 % p))
            if self.stepped:  # its other owners may leave in this step: keep it until the end
                self._step_refs.append(old)
            else:
                self.pool.drop([old])
            seq.private[seq.private.index(old)] = dst
            seq.table[-1] = dst
            self.stats.cow_copies += 1
        seq.table.extend(fresh)
        seq.private.extend(fresh)
        if type(seq.tokens) is bytes:  # first append: the prompt's buffer becomes growable
            seq.tokens = bytearray(seq.tokens)
        seq.tokens += data
        seq.num_tokens = t1
        seq.unconfirmed = True
        self.stats.appended_tokens += k
        if self.enable_caching and t1 // p > t0 // p:
            now = self._now()
            self._commit(seq, seq.tokens, t1 // p, None, now)
            if seq.claim is not None:  # the blocks it decoded carry its claim too
                self._set_priority(seq.deepest, *seq.claim, now)
        if k == 1:
            slots = np.array([seq.table[t0 // p] * p + t0 % p], dtype=np.int64)
        else:
            slots = slots_of(seq.table, p, t0, t1)
        return AppendResult(slots, copies)

    def _append_need(self, seq: RequestState, k: int) -> int:
        p, t0 = self.block_size, seq.num_tokens
        need = -(-(t0 + k) // p) - len(seq.table)
        if k and t0 % p and self.pool.refcount[seq.table[-1]] > 1:
            need += 1
        return need

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks, the partial last
        one too (parallel sampling, beam search). Writes copy on demand."""
        parent = self._seq(parent_id)
        if self._is_live(child_id):
            raise DuplicateRequestError(f"request {child_id!r} is already admitted")
        child = RequestState(
            child_id,
            parent.namespace,
            bytearray(parent.tokens),
            parent.num_tokens,
            list(parent.table),
            parent.deepest,
        )
        child.private = list(parent.private)
        child.blocked = parent.blocked
        child.claim = parent.claim
        self.pool.share(child.private)
        self.index.hold(child.deepest, self._now())
        if parent.unconfirmed:  # it reads what the parent still has to write
            deps = parent.dependents
            if deps:
                if len(deps) >= 16 and not len(deps) & (len(deps) - 1):  # at 16, 32, 64, ...
                    deps[:] = [d for d in deps if self._is_live_seq(d) or d.dependents or d.pending]
                deps.append(child)
            else:
                parent.dependents = [child]
            child.unconfirmed = True  # and passes that on to its own forks
        self._seqs[child_id] = child
        self.stats.forks += 1

    def release(self, request_id: Hashable) -> None:
        """Finish a request whose K/V has been written. Its indexed blocks stay cached
        (evictable); private ones are freed. Use ``abort`` when its K/V was never written."""
        seq = self._seq(request_id)
        del self._seqs[request_id]  # what it wrote is confirmed: nothing of it stays pending
        if seq.copy_source is not None:
            self._unhold(seq.copy_source)
        self._unhold(seq.deepest)
        self.pool.drop(seq.private)

    def abort(self, request_id: Hashable) -> list[Hashable]:
        """Drop a request before the forward pass wrote its K/V (preempted while the step is
        planned, a client gone before its prefill).

        The blocks it entered into the index since its K/V was last confirmed leave the index,
        and every live request that relies on them (a hit on them, a partial copy from them, a
        fork taken before they were written) is dropped too. Returns the ids dropped, this one
        first; requeue them all, and take their slots and copies out of the step's batch: their
        blocks may be handed out again at once (preemption makes room in the same step).
        """
        seq = self._seq(request_id)
        doomed, tops = self._dependents(seq)
        now = self._now()
        if self._step_holds:  # the copies of dropped requests do not run
            gone = {id(dead) for dead in doomed}
            region = {id(top) for top in tops}  # and no hold may keep a node that leaves
            keep = []
            for node, owner in self._step_holds:
                if id(owner) in gone or _under(node, region):
                    self._unhold(node)
                else:
                    keep.append((node, owner))
            self._step_holds = keep
        for dead in doomed:
            del self._seqs[dead.request_id]
            self._drop(dead)
        for top in sorted(tops, key=lambda node: node.depth):
            if top.parent is None:  # inside a region removed already
                continue
            parent = top.parent
            namespace = self.index.namespace_of(top)
            for _, ids, digests in self.index.remove_subtree(top):
                self.pool.give_back(ids)
                self.stats.unindexed_blocks += len(ids)
                if self._listeners:
                    self._emit(BlockRemoved(_split_digests(digests), namespace))
                if self.host is not None:
                    for d in _split_digests(digests):
                        self._drop_host_below(d)
            if parent.parent is not None and self.evictor.evictable(parent):
                self.evictor.push(parent, now)
        self.stats.aborted_requests += len(doomed)
        return [dead.request_id for dead in doomed]

    def end_step(self) -> None:
        """The forward pass of the step has written every K/V it was given: pending blocks
        become ordinary cached blocks, and the copy sources held for the step are let go."""
        for seq in self._seqs.values():
            if seq.unconfirmed:
                _confirm(seq)
        for node, _ in self._step_holds:
            self._unhold(node)
        self._step_holds.clear()
        self.pool.drop(self._step_refs)
        self._step_refs.clear()
        if self.host is not None:
            self.host.release_deferred()

    def take_transfers(self) -> Transfers:
        """The host-tier transfers planned since the last call, and forget them. Run every
        offload, then every load, after planning the step and before its forward pass."""
        out = Transfers(self._offloads, self._loads)
        self._offloads, self._loads = [], []
        return out

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks now (policy order); returns how many."""
        count = min(
            as_size(num_blocks, "num_blocks"), self.index.num_blocks - self.index.active_blocks
        )
        if count:
            self._evict(count)
        return count

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """Keep the cached prefix of ``tokens`` from eviction (system prompts, attention sinks).

        Returns ``(handle, pinned_tokens)``; only what is cached and written now is pinned.
        """
        arr = as_token_array(tokens)
        _check_namespace(namespace)
        root = self.index.roots.get(namespace)
        if root is None:
            return 0, 0
        buf = arr.tobytes()
        match = self.index.match(root, buf, len(arr) // self.block_size)
        pending = self.pending_blocks
        if pending and match.n:
            blocks = self.index.path_blocks(match.node)[: match.n]
            written = next((i for i, b in enumerate(blocks) if b in pending), None)
            if written is not None:
                match = self.index.match(root, buf, written)
        if match.n == 0:
            return 0, 0
        node = match.node
        if match.j < len(node.blocks):
            node = self.index.split(node, match.j)
        self.index.hold(node, self._now())
        handle = next(self._pin_ids)
        self._pins[handle] = node
        return handle, match.n * self.block_size

    def unpin(self, handle: int) -> None:
        """Let a pinned prefix be evicted again (``handle`` from ``pin``; 0: pinned nothing)."""
        if type(handle) is not int:
            raise InvalidArgumentError(f"a pin handle is an int from pin(), got {handle!r}")
        if handle == 0:
            return
        node = self._pins.pop(handle, None)
        if node is None:
            raise UnknownRequestError(f"pin handle {handle!r} is not active")
        self._unhold(node)

    # ---- views ----------------------------------------------------------------------------
    def block_table(self, request_id: Hashable) -> list[int]:
        return list(self._seq(request_id).table)

    def num_tokens(self, request_id: Hashable) -> int:
        return self._seq(request_id).num_tokens

    def token_ids(self, request_id: Hashable) -> np.ndarray:
        return np.frombuffer(bytes(self._seq(request_id).tokens), dtype="<i4")

    def block_tables(
        self, request_ids: Iterable[Hashable], device: Any = "cpu", pad: int = -1
    ) -> Any:
        """Block tables as an int32 torch tensor ``[batch, max_blocks]`` on ``device``."""
        import torch

        if (
            isinstance(pad, bool)
            or not isinstance(pad, int | np.integer)
            or not -(2**31) <= pad < 2**31
        ):
            raise InvalidArgumentError(f"pad must be an int32 block id or marker, got {pad!r}")
        tables = [self._seq(r).table for r in request_ids]
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        width = int(lens.max()) if len(tables) else 0
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
        out = np.full((len(tables), width), pad, dtype=np.int32)
        out[np.arange(width) < lens[:, None]] = flat  # row-major fill of each row's prefix
        return torch.from_numpy(out).to(device)

    @property
    def requests(self) -> list[Hashable]:
        return list(self._seqs)

    @property
    def states(self) -> Mapping[Hashable, RequestState]:
        """Read-only view of every live request's state (integrity checks, tools)."""
        return MappingProxyType(self._seqs)

    @property
    def pins(self) -> Mapping[int, Node]:
        """Read-only view of the active pins: handle -> the deepest pinned node."""
        return MappingProxyType(self._pins)

    @property
    def pending_blocks(self) -> frozenset[int]:
        """Indexed blocks whose K/V no ``end_step`` or ``release`` has confirmed yet."""
        return frozenset(b for seq in self._seqs.values() for b in seq.pending)

    @property
    def step_holds(self) -> tuple[list[Node], list[int]]:
        """Copy sources held until ``end_step`` (stepped): index nodes and private blocks."""
        return [node for node, _ in self._step_holds], list(self._step_refs)

    @property
    def clock_ticks(self) -> float:
        """The internal clock used when no ``clock`` was given (advances once per event)."""
        return self._tick

    def block_counts(self) -> BlockCounts:
        active = self.index.active_blocks + self.pool.num_private
        cached = self.index.num_blocks - self.index.active_blocks
        return BlockCounts(self.pool.num_free, active, cached)

    def add_listener(self, listener: EventListener) -> None:
        """Call ``listener`` with BlockStored / BlockRemoved / AllBlocksCleared events.

        Events are emitted in the middle of an operation, so a listener that raises cannot stop
        it: the error is logged and counted in ``listener_errors``, and the operation completes
        (the cache stays consistent; that listener misses the event)."""
        if not callable(listener):
            raise InvalidArgumentError(
                f"a listener must be a callable (it is called with each event), got {listener!r}"
            )
        self._listeners = [*self._listeners, listener]  # a new list: events being sent keep theirs

    def remove_listener(self, listener: EventListener) -> None:
        """Stop calling ``listener`` (InvalidArgumentError when it was not added); safe from
        inside a listener or another thread: an event being sent still reaches the others."""
        listeners = list(self._listeners)
        try:
            listeners.remove(listener)
        except ValueError:
            raise InvalidArgumentError(f"{listener!r} is not a listener of this manager") from None
        self._listeners = listeners

    def reset(self, *, force: bool = False) -> None:
        """Drop every cached block. Refuses while requests or pins hold blocks unless forced;
        a forced reset also drops every request and pin."""
        in_use = self.block_counts().active
        if in_use and not force:
            held = len(self._step_holds) + len(self._step_refs)
            step = f" and {held} holds of this step (end_step() ends them)" if held else ""
            raise CacheInUseError(
                f"{in_use} blocks are in use by {len(self._seqs)} requests and {len(self._pins)}"
                f" pins{step}; release them first or pass force=True"
            )
        self._seqs.clear()
        self._pins.clear()
        self._step_holds.clear()
        self._step_refs.clear()
        self.index = RadixIndex(self.hasher)
        self.pool.reset()
        self.evictor.clear()
        if self.host is not None:
            self.host.clear()
        self._offloads, self._loads = [], []
        self._emit(AllBlocksCleared())

    # ---- internals ------------------------------------------------------------------------
    def _seq(self, request_id: Hashable) -> RequestState:
        try:
            seq = self._seqs.get(request_id)
        except TypeError:
            raise InvalidArgumentError(_UNHASHABLE.format(type(request_id).__name__)) from None
        if seq is None:
            raise UnknownRequestError(f"request {request_id!r} is not admitted (or was released)")
        return seq

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        self._tick += 1.0
        return self._tick

    @staticmethod
    def _set_priority(node: Node | None, priority: int, until: float, now: float) -> None:
        """Add a request's retention claim (kept until ``until``) to its path. A node keeps the
        claims that can still decide: the highest live priority wins, and a lower one that
        outlives it takes over when its retention ends. A node that keeps the claim already has
        it on its whole path (it was added to the path, or dropped where a claim that outlasts
        it wins): the walk stops there, so a decoding request adds it to its new blocks only."""
        claim = (priority, until)
        while node is not None and node.parent is not None:
            if (node.priority, node.retain_until) == claim or claim in node.later:
                return
            claims = [(node.priority, node.retain_until), *node.later, claim]
            claims.sort(key=lambda c: (-c[0], -c[1]))
            kept: list[tuple[int, float]] = []
            for c in claims:  # a claim counts while no higher one outlasts it
                if c[1] > now and (not kept or c[1] > kept[-1][1]):
                    kept.append(c)
            node.priority, node.retain_until = kept[0] if kept else (0, 0.0)
            node.later = tuple(kept[1:])
            node = node.parent

    def _drop(self, seq: RequestState) -> None:
        """Give back everything a request holds (it has left ``_seqs`` already)."""
        if seq.copy_source is not None:
            self._unhold(seq.copy_source)
            seq.copy_source = None
        self._unhold(seq.deepest)
        self.pool.drop(seq.private)

    def _is_live_seq(self, seq: RequestState) -> bool:
        return self._seqs.get(seq.request_id) is seq

    def _is_live(self, request_id: Hashable) -> bool:
        try:
            return request_id in self._seqs
        except TypeError:
            raise InvalidArgumentError(_UNHASHABLE.format(type(request_id).__name__)) from None

    def _dependents(self, seq: RequestState) -> tuple[list[RequestState], list[Node]]:
        """``seq`` and every live request that relies on K/V it (or they, in turn) has not
        written yet, plus the top node of each one's unwritten indexed blocks. The forks of a
        fork released already count too: they read what ``seq`` never wrote through it."""
        doomed, seen, tops = [seq], {id(seq)}, []
        chain = [seq]  # the doomed and the released forks between them
        region: set[int] = set()  # ids of nodes in unwritten regions
        i = 0
        while True:
            while i < len(chain):
                cur = chain[i]
                i += 1
                if not cur.unconfirmed:
                    continue
                for dep in cur.dependents:
                    if id(dep) not in seen:
                        seen.add(id(dep))
                        chain.append(dep)
                        if self._seqs.get(dep.request_id) is dep:
                            doomed.append(dep)
                if cur.deepest is not None and cur.deepest.parent is None:
                    continue  # released, and its blocks left the index since
                top = self._pending_top(cur)
                if top is not None:
                    tops.append(top)
                    stack = [top]
                    while stack:
                        node = stack.pop()
                        region.add(id(node))
                        if node.children:
                            stack.extend(node.children.values())
            grew = False
            if region:
                readers: list[tuple[Node | None, RequestState]]
                readers = [(s.deepest, s) for s in self._seqs.values()]
                readers += [(s.copy_source, s) for s in self._seqs.values()]
                readers += [(node, s) for node, s in self._step_holds]
                for held, other in readers:
                    if id(other) in seen or self._seqs.get(other.request_id) is not other:
                        continue
                    if _under(held, region):
                        seen.add(id(other))
                        doomed.append(other)
                        chain.append(other)
                        grew = True
            if not grew:
                return doomed, tops

    def _pending_top(self, seq: RequestState) -> Node | None:
        """The node that starts ``seq``'s unconfirmed indexed blocks (split off if needed)."""
        start = seq.pending_start
        node = seq.deepest
        if start is None or node is None:
            return None
        while node.parent is not None and node.depth > start:
            node = node.parent
        assert node.parent is not None and node.depth <= start < node.end
        if node.depth < start:
            self.index.split(node, start - node.depth)  # ``node`` keeps the lower part
        return node

    def _unhold(self, node: Node | None) -> None:
        now = self._now()
        leaf = self.index.unhold(node, now)
        if leaf is not None:
            self.evictor.push(leaf, now)
            self.evictor.compact(self.index.num_nodes)

    def _take(self, k: int, *, owned: bool = True) -> list[int]:
        """``k`` private blocks, evicting exactly the deficit (capacity was checked). Not
        ``owned``: no refcounts yet (see ``BlockPool.take_unowned``)."""
        deficit = k - self.pool.num_free
        if deficit > 0:
            self._evict(deficit)
        return self.pool.take(k) if owned else self.pool.take_unowned(k)

    def _evict(self, count: int) -> None:
        now = self._now()
        while count > 0:
            node = self.evictor.pop(now)
            assert node is not None, "capacity check admitted more than is evictable"
            k = min(count, len(node.blocks))
            parent = node.parent
            host = self.host
            namespace = node.namespace if self._listeners or host is not None else None
            if host is not None:  # what an offload needs, read before the tail goes
                assert parent is not None
                first = len(node.blocks) - k
                prev = node.digest(first - 1) if first else parent.last_digest()
                run = bytes(node.tokens[first * self.index.block_bytes :])
                position = node.depth + first
            ids, digests = self.index.evict_tail(node, k)
            self.pool.give_back(ids)
            self.stats.evicted_blocks += k
            count -= k
            if namespace is not None:
                if self._listeners:
                    self._emit(BlockRemoved(_split_digests(digests), namespace))
                if host is not None:
                    self._offload(ids, _split_digests(digests), run, prev, position, namespace)
            if node.blocks:
                self.evictor.push(node, now)
            elif (
                parent is not None and parent.parent is not None and self.evictor.evictable(parent)
            ):
                self.evictor.push(parent, now)

    def _offload(
        self,
        ids: list[int],
        digests: list[bytes],
        run: bytes,
        prev: bytes,
        position: int,
        namespace: Namespace,
    ) -> None:
        """Put blocks just evicted from the GPU (a chain, first block first; ``prev`` is the
        first one's parent digest) on host, while room can be made; the rest are dropped, with
        what descends from them on host."""
        host = self.host
        assert host is not None
        slots, evicted = host.put_run(digests, prev, run, position, namespace)
        if evicted:
            self.stats.host_evicted_blocks += len(evicted)
            self._emit_host_removed(evicted)
        stored = len(slots)
        self._offloads += [_new(Offload, pair) for pair in zip(ids, slots, strict=False)]
        if stored < len(digests):  # no room: they leave the cache, with what is below them
            for gone in digests[stored:]:
                self._drop_host_below(gone)
        self.stats.offloaded_blocks += stored
        if stored and self._listeners:
            bb = self.index.block_bytes
            tokens = np.frombuffer(run[: stored * bb], dtype="<i4").tolist()
            parent = prev if position else None  # a chain's first block has no parent
            self._emit(
                BlockStored(digests[:stored], parent, tokens, self.block_size, namespace, "CPU")
            )

    def _unload(self, digests: list[bytes], namespace: Namespace) -> list[int]:
        """Take a run of blocks to load off host; returns their slots (free once the step's
        loads have run)."""
        host = self.host
        assert host is not None
        slots = [host.remove(d, defer=True).slot for d in digests]
        if self._listeners:
            self._emit(BlockRemoved(list(digests), namespace, "CPU"))
        return slots

    def _drop_host_below(self, digest: bytes) -> None:
        """The block ``digest`` leaves the cache: so does everything below it on host."""
        assert self.host is not None
        dropped = self.host.drop_below(digest)
        if dropped:
            self.stats.host_evicted_blocks += len(dropped)
            self._emit_host_removed(dropped)

    def _emit_host_removed(self, entries: list[tuple[bytes, HostEntry]]) -> None:
        """BlockRemoved (CPU) events for entries that left the host tier, one per namespace run."""
        if not self._listeners:
            return
        i = 0
        while i < len(entries):
            namespace = entries[i][1].namespace
            j = i
            while j < len(entries) and entries[j][1].namespace == namespace:
                j += 1
            self._emit(BlockRemoved([d for d, _ in entries[i:j]], namespace, "CPU"))
            i = j

    def _commit(
        self,
        seq: RequestState,
        buf: bytes | bytearray,
        upto: int,
        digest: bytes | None,
        now: float,
        *,
        owned: bool = True,
    ) -> None:
        """Enter the sequence's full blocks up to ``upto`` (``buf``: its int32 LE tokens) into
        the index, in order; they are pending until confirmed. A block already cached by another
        sequence stays private here (a duplicate) and the path moves onto the cached one; a
        digest collision stops.
        ``owned``: the blocks carry refcounts to drop (not so for a fresh admission's)."""
        if seq.blocked:
            return
        parent = seq.deepest
        start = parent.end if parent is not None else 0
        if upto <= start:
            return
        if parent is None:
            parent = self.index.root(seq.namespace)
        if digest is None:
            digest = parent.last_digest()
        digests = self.hasher.hash_buffer(buf, digest, start, upto)
        if parent.children and digests[0] in parent.children:  # blocks someone cached already
            followed = self._follow_cached(seq, parent, digests, buf, now)
            if followed is None:
                return
            parent = followed
        i = parent.end if parent.parent is not None else 0
        if i < upto:
            prev = digests[i - start - 1] if i > start else (digest if i > 0 else None)
            self._store(seq, parent, digests[i - start :], buf, i, upto, prev, now, owned)

    def _follow_cached(
        self,
        seq: RequestState,
        parent: Node,
        digests: list[bytes],
        buf: bytes | bytearray,
        now: float,
    ) -> Node | None:
        """Move the sequence's path over blocks someone else cached already (its own stay
        private duplicates). Returns the last node followed; None when a digest collision
        stopped the sequence."""
        start = i = parent.end if parent.parent is not None else 0
        upto = start + len(digests)
        while i < upto and parent.children:
            child = parent.children.get(digests[i - start])
            if child is None:
                break
            k = min(len(child.blocks), upto - i)
            m = self.index.common_blocks(child, buf, i, k)
            if m == 0:
                seq.blocked = True
                return None
            if m < len(child.blocks):
                child = self.index.split(child, m)
            self.index.hold(child, now, upto=parent)
            parent, i = child, i + m
            seq.deepest = parent
        return parent

    def _store(
        self,
        seq: RequestState,
        parent: Node,
        digests: list[bytes],
        buf: bytes | bytearray,
        i: int,
        upto: int,
        prev: bytes | None,
        now: float,
        owned: bool,
    ) -> None:
        """Index the sequence's own blocks ``i .. upto-1`` (``digests``) after ``parent``; they
        are pending. ``prev`` is the digest before them, for the event; ``owned``: they carry
        refcounts to drop."""
        bb = self.index.block_bytes
        ids = seq.table[i:upto]
        run = buf[i * bb : upto * bb]
        node = self.index.add(parent, digests, run, ids, now)
        if owned:
            self.pool.to_index(ids)
        private = seq.private
        if private[: len(ids)] == ids:  # the usual case: the oldest private blocks
            del private[: len(ids)]
        else:
            gone = set(ids)
            seq.private = [b for b in private if b not in gone]
        if seq.pending_start is None:
            seq.pending_start = i
            seq.pending = ids[:]
        else:  # a list by now
            seq.pending.extend(ids)  # type: ignore[union-attr]
        self.stats.stored_blocks += len(ids)
        host = self.host
        if host is not None and host.entries and not host.entries.keys().isdisjoint(digests):
            # computed again: the GPU copy replaces the host's
            twins = [d for d in digests if d in host.entries]
            replaced = [(d, host.remove(d, defer=False)) for d in twins]
            self.stats.host_evicted_blocks += len(replaced)
            self._emit_host_removed(replaced)
        if self._listeners:
            tokens = np.frombuffer(run, dtype="<i4").tolist()
            namespace = self.index.namespace_of(node)
            self._emit(BlockStored(digests, prev, tokens, self.block_size, namespace))
        seq.deepest = node

    def _emit(self, event: Any) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # mid-operation: raising here would leave the state half-changed
                self.listener_errors += 1
                log.exception("event listener %r failed on %s", listener, type(event).__name__)

    # ---- verification ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant the bookkeeping can see (docs/architecture.md). O(cache)."""
        from prefixcache.integrity import check_manager

        check_manager(self)


def _split_digests(digests: bytes) -> list[bytes]:
    return [digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)]


def _under(node: Node | None, region: set[int]) -> bool:
    while node is not None and node.parent is not None:
        if id(node) in region:
            return True
        node = node.parent
    return False


_new = tuple.__new__  # a NamedTuple from a tuple in C (its generated __new__ is a Python call)

_UNHASHABLE = "request ids must be hashable (a str, an int, a tuple of them), got {}"


def _confirm(seq: RequestState) -> None:
    """Its K/V is written: nothing of it is pending and nothing depends on its writes."""
    seq.unconfirmed = False
    seq.pending = ()
    seq.pending_start = None
    seq.dependents = ()


def _check_transfer_model(model: Any) -> None:
    if not isinstance(model, TransferModel):
        raise ConfigError(f"transfer_model must be a TransferModel or None, got {model!r}")
    for name, value in zip(model._fields, model, strict=True):
        at_least = "a number >= 0" if name in ("flops_per_token", "flops_per_pair") else None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and at_least is None)
        ):
            raise ConfigError(
                f"transfer_model.{name} must be {at_least or 'a positive number'}, got {value!r}"
            )
    if model.flops_per_token == model.flops_per_pair == 0:
        raise ConfigError("transfer_model needs flops_per_token or flops_per_pair above 0")


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, Namespace):
        raise InvalidArgumentError(
            f"namespace must be a prefixcache.Namespace, got {type(namespace).__name__}; "
            "build one with Namespace(model=..., adapter=..., salt=...)"
        )


def _check_priority(priority: Any, retention: Any) -> None:
    if type(priority) is not int and not isinstance(priority, np.integer):
        raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
    if retention is None:
        return
    if isinstance(retention, bool) or not isinstance(retention, int | float | np.number):
        raise InvalidArgumentError(
            f"retention must be a number of clock units or None, got {retention!r}"
        )
    if math.isnan(retention) or retention < 0:
        raise InvalidArgumentError(f"retention must be >= 0, got {retention!r}")
