"""The fleet router: prompt -> digest chain -> index match -> per-replica scores -> a policy.

``Router`` has no HTTP in it: the service calls it from request handlers, a fleet replay calls it
in process. It is thread-safe: hashing and the index lookup run outside its lock (the index is
written concurrently by the event ingestion and answers on its own), the choice and the load
bookkeeping run under it, so two concurrent routes always see each other's load. What it keeps
per replica besides its ``ReplicaSpec``: the in-flight load (``replica_load``) and whether it
takes routes (``replica_health``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import TokenIds, as_size, as_token_array
from prefixcache.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    NoHealthyReplicaError,
    PayloadTooLargeError,
    UnknownNamespaceError,
    UnknownReplicaError,
    UnknownRequestError,
)
from prefixcache.fleet.events.store_blocks import store_holder
from prefixcache.fleet.events.tenant_tally import tenant_of
from prefixcache.fleet.index.interface import FleetIndex, ReplicaMatch
from prefixcache.fleet.policies import (
    DEFAULT_POLICY,
    Policy,
    ReplicaScore,
    RouteContext,
    RoutingParams,
    check_params,
    get_policy,
)
from prefixcache.fleet.replica_health import HealthMarks, ReplicaHealth
from prefixcache.fleet.replica_load import InFlightLoads, Released, ReplicaLoad
from prefixcache.fleet.replica_spec import ReplicaSpec, served_label
from prefixcache.medium import GPU

MAX_REQUEST_ID_CHARS = 256


class PromptScores(NamedTuple):
    """Per-replica scores of a prompt, without routing it."""

    namespace: Namespace
    prompt_tokens: int
    scores: tuple[ReplicaScore, ...]  # eligible replicas, in configured order


class RouteDecision(NamedTuple):
    """Where a prompt goes, and why."""

    replica: str
    policy: str
    rule: str  # the rule of the policy that decided (see policies.Choice)
    request_id: str | None  # None: the route was not recorded as load
    prompt_tokens: int
    cached_tokens: int  # on the chosen replica
    gpu_cached_tokens: int
    scores: tuple[ReplicaScore, ...]


class _Matches(NamedTuple):
    """What the index says about a prompt, read before the router's lock is taken."""

    prompt_tokens: int
    eligible: list[ReplicaSpec]  # the replicas serving its namespace
    found: dict[str, ReplicaMatch]  # replica -> its leading cached blocks
    held_blocks: dict[str, int]  # GPU blocks the index holds, for replicas with a known capacity
    tokens: np.ndarray
    digests: dict[int, list[bytes]]  # by block size
    store_only: dict[str, int]  # replica -> leading blocks in reach only through its store


class RouteObserver(Protocol):
    """Told of every route, after it is decided (``Router.attach_observer``)."""

    def __call__(
        self, replica: str, digests: Sequence[bytes], prompt_tokens: int, block_size: int
    ) -> None:
        """The prompt (its full blocks' digests at the chosen replica's ``block_size``, root
        first) went to ``replica``."""


class HeldBlocks(Protocol):
    """Blocks replicas hold that the index cannot place yet (stored under a parent the event
    ingestion never saw): ``KVEventSubscriber.unplaced``."""

    def match(
        self, replica: str, namespace: Namespace, tokens: np.ndarray, digests: Sequence[bytes]
    ) -> ReplicaMatch | None:
        """What ``replica`` holds of a prompt, counting those blocks (None: nothing to add)."""

    def note_route(
        self, replica: str, namespace: Namespace, tokens: np.ndarray, digests: Sequence[bytes]
    ) -> None:
        """The prompt was routed to ``replica``."""


class Router:
    """Scores prompts against a ``FleetIndex`` and routes them with a policy from
    ``policies.POLICIES``, keeping the in-flight load of every replica.

    ``in_flight_timeout`` (seconds on ``clock``; None: never) ends the load of a routed request
    that was never released, e.g. because its client died: without it such loads would skew
    every later choice for good. Expired requests are counted (``expired()``).

    A replica ``mark_down`` (a failed request, a failed health probe) takes no routes until the
    time given passes or ``mark_up``; lookups still score it.

    ``held`` (``attach_held``) adds what the index cannot place yet to every lookup and hears of
    every route (``HeldBlocks``).
    """

    def __init__(
        self,
        index: FleetIndex,
        replicas: Iterable[ReplicaSpec],
        policy: str = DEFAULT_POLICY,
        params: RoutingParams | None = None,
        *,
        hash_algo: str = "xxh3_128",
        max_prompt_tokens: int | None = None,
        in_flight_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        held: HeldBlocks | None = None,
    ) -> None:
        self._held = held
        self._observer: RouteObserver | None = None
        self._tenant_shares: dict[str, int] = {}
        self._tenant_blocks: Callable[[str], Mapping[str, int]] | None = None
        if in_flight_timeout is not None and (
            isinstance(in_flight_timeout, bool)
            or not isinstance(in_flight_timeout, int | float)
            or not in_flight_timeout > 0
            or math.isinf(in_flight_timeout)
        ):
            raise InvalidArgumentError(
                "in_flight_timeout must be a positive number of seconds or None, got "
                f"{in_flight_timeout!r}"
            )
        self._timeout = in_flight_timeout
        self._clock = clock
        self._index = index
        self._policy_name = policy
        self._policy: Policy = get_policy(policy)
        self._params = check_params(params if params is not None else RoutingParams())
        self._hash_algo = hash_algo
        BlockHasher(1, hash_algo)  # checks the algorithm name now
        self._max_tokens = (
            None
            if max_prompt_tokens is None
            else as_size(max_prompt_tokens, "max_prompt_tokens", 1)
        )
        self._lock = threading.Lock()
        self._specs: dict[str, ReplicaSpec] = {}
        self._loads = InFlightLoads(clock)
        self._health = HealthMarks()
        self._turns: dict[tuple[str, ...], int] = {}  # by eligible replicas: bounded
        self._hashers: dict[int, BlockHasher] = {}
        for spec in replicas:
            self.add_replica(spec)

    # ---- configuration ------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        """Name of the routing policy."""
        return self._policy_name

    @property
    def params(self) -> RoutingParams:
        """Thresholds of the policy."""
        return self._params

    @property
    def index(self) -> FleetIndex:
        """The index the router reads."""
        return self._index

    def attach_tenant_shares(
        self, shares: Mapping[str, int], blocks: Callable[[str], Mapping[str, int]] | None
    ) -> None:
        """Prefer, for a tenant's prompt, replicas where the tenant holds fewer GPU blocks than
        its share (``shares``: tenant -> blocks per replica; ``blocks(tenant)``: replica -> its
        GPU blocks there, from the KV events): the policy chooses among those and any replica
        holding the prompt's longest prefix; among all when none has room."""
        self._tenant_shares = dict(shares)
        self._tenant_blocks = blocks

    def _with_room(
        self, namespace: Namespace, scores: tuple[ReplicaScore, ...]
    ) -> tuple[ReplicaScore, ...]:
        """``scores`` less the replicas where the prompt's tenant is at its share (keeping any
        with the longest cached prefix); all of them when none has room."""
        tenant = tenant_of(namespace.salt)
        share = self._tenant_shares.get(tenant) if tenant is not None else None
        if share is None or self._tenant_blocks is None or tenant is None:
            return scores
        held = self._tenant_blocks(tenant)
        best = max(s.cached_tokens for s in scores)
        kept = tuple(
            s for s in scores if held.get(s.name, 0) < share or (best and s.cached_tokens == best)
        )
        return kept or scores

    def attach_observer(self, observer: RouteObserver | None) -> None:
        """Tell ``observer`` of every route from now on (None: stop); it runs on the routing
        thread, outside the router's lock."""
        self._observer = observer

    def attach_held(self, held: HeldBlocks | None) -> None:
        """Consult ``held`` on every lookup and route from now on (None: the index alone)."""
        self._held = held

    def add_replica(self, spec: ReplicaSpec) -> None:
        """Add a replica to the fleet; InvalidArgumentError if the name is taken or a field is
        out of range."""
        if not isinstance(spec, ReplicaSpec):
            raise InvalidArgumentError(f"expected a ReplicaSpec, got {type(spec).__name__}")
        if not isinstance(spec.name, str) or not spec.name:
            raise InvalidArgumentError(f"replica name must be a non-empty str, got {spec.name!r}")
        if not isinstance(spec.namespace, Namespace):
            raise InvalidArgumentError(f"replica {spec.name!r}: namespace must be a Namespace")
        block_size = as_size(spec.block_size, "block_size", 1)
        capacity = as_size(spec.capacity_blocks, "capacity_blocks", 0)
        adapters = spec.adapters
        if not isinstance(adapters, tuple | list) or not all(
            isinstance(a, str) and a for a in adapters
        ):
            raise InvalidArgumentError(
                f"replica {spec.name!r}: adapters must be non-empty str, got {adapters!r}"
            )
        with self._lock:
            if spec.name in self._specs:
                raise InvalidArgumentError(f"replica {spec.name!r} is already in the fleet")
            if block_size not in self._hashers:
                self._hashers[block_size] = BlockHasher(block_size, self._hash_algo)
            self._specs[spec.name] = spec._replace(
                block_size=block_size, capacity_blocks=capacity, adapters=tuple(adapters)
            )
            self._loads.add_replica(spec.name)

    def remove_replica(self, name: str) -> ReplicaSpec:
        """Take a replica out of the fleet and out of the index; its in-flight requests can
        still be released. UnknownReplicaError if it is not in the fleet."""
        with self._lock:
            spec = self._specs.pop(name, None) if isinstance(name, str) else None
            if spec is None:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            self._loads.remove_replica(name)
            self._health.forget(name)
        self._index.drop_replica(name)
        return spec

    def replicas(self) -> list[ReplicaSpec]:
        """Every replica of the fleet, in the order they were added."""
        with self._lock:
            return list(self._specs.values())

    def namespaces(self) -> list[Namespace]:
        """The namespaces the fleet serves, each once, in order of first appearance."""
        with self._lock:
            return list(dict.fromkeys(s.namespace for s in self._specs.values()))

    def loads(self) -> list[ReplicaLoad]:
        """In-flight requests and tokens per replica, in fleet order."""
        with self._lock:
            self._loads.expire()
            return self._loads.loads(self._specs)

    def in_flight(self) -> int:
        """Requests routed with an id and not yet released (also those of removed replicas)."""
        with self._lock:
            self._loads.expire()
            return len(self._loads.requests)

    def in_flight_among(self, request_ids: Iterable[str]) -> set[str]:
        """Those of ``request_ids`` still in flight (routed, not released, not expired)."""
        with self._lock:
            self._loads.expire()
            requests = self._loads.requests
            return {rid for rid in request_ids if rid in requests}

    def expired(self) -> int:
        """Routed requests whose load ended by the timeout, never released."""
        with self._lock:
            self._loads.expire()
            return self._loads.expired

    def mark_down(self, name: str, seconds: float, reason: str) -> None:
        """Route nothing to replica ``name`` for ``seconds`` (it failed a request or a health
        probe); a later mark extends or shortens it. UnknownReplicaError if not in the fleet."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise InvalidArgumentError(f"seconds must be a positive number, got {seconds!r}")
        with self._lock:
            if name not in self._specs:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            now = self._clock()
            self._health.mark_down(name, now + seconds, str(reason), now)

    def mark_up(self, name: str) -> None:
        """Replica ``name`` takes routes again (a health probe succeeded)."""
        with self._lock:
            if name not in self._specs:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            self._health.mark_up(name)

    def health(self) -> list[ReplicaHealth]:
        """Up or down, per replica, in fleet order."""
        with self._lock:
            return self._health.health(self._specs, self._clock())

    # ---- lookups and routes -------------------------------------------------------------------

    def _eligible(self, namespace: Namespace) -> list[ReplicaSpec]:
        """The replicas serving ``namespace``; UnknownNamespaceError when there is none."""
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(
                f"namespace must be a Namespace, got {type(namespace).__name__}"
            )
        with self._lock:
            eligible = [s for s in self._specs.values() if s.serves(namespace)]
            served = [] if eligible else [served_label(s) for s in self._specs.values()]
        if not eligible:
            listing = ", ".join(dict.fromkeys(served)) or "none"
            raise UnknownNamespaceError(
                f"no replica serves namespace {namespace.label()}; served: {listing}"
            )
        return eligible

    def _matches(
        self, namespace: Namespace, tokens: TokenIds, given: Sequence[bytes] | None = None
    ) -> _Matches:
        """Everything a route reads from the index, outside the router's lock (``given``: the
        prompt's digests, computed by the caller, for replicas of one block size)."""
        arr = as_token_array(tokens)
        n = len(arr)
        if self._max_tokens is not None and n > self._max_tokens:
            raise PayloadTooLargeError(
                f"prompt has {n} tokens; this service accepts at most {self._max_tokens}"
            )
        eligible = self._eligible(namespace)
        by_size: dict[int, list[ReplicaSpec]] = {}
        for spec in eligible:
            by_size.setdefault(spec.block_size, []).append(spec)
        found: dict[str, ReplicaMatch] = {}
        chains: dict[int, list[bytes]] = {}
        store_only: dict[str, int] = {}
        extra = self._held
        for block_size, specs in by_size.items():
            if given is not None and len(by_size) == 1 and len(given) == n // block_size:
                digests = list(given)
            else:
                hasher = self._hashers[block_size]
                digests = hasher.hash_blocks(arr, hasher.seed(namespace), 0, n // block_size)
            if not digests:
                continue
            chains[block_size] = digests
            wanted = {s.name for s in specs}
            holders = {store_holder(s.kv_store): s for s in specs if s.kv_store is not None}
            in_stores: dict[str, ReplicaMatch] = {}
            for match in self._index.match(digests):
                if match.replica in wanted:
                    found[match.replica] = match
                elif match.replica in holders:
                    in_stores[match.replica] = match
            if in_stores:  # a shared store's blocks are in reach of every replica attached
                for spec in specs:
                    pooled = in_stores.get(store_holder(spec.kv_store or ""))
                    old = found.get(spec.name)
                    if pooled is not None and (old is None or pooled.blocks > old.blocks):
                        gpu, own = (old.gpu_blocks, old.blocks) if old is not None else (0, 0)
                        found[spec.name] = ReplicaMatch(spec.name, pooled.blocks, gpu)
                        store_only[spec.name] = pooled.blocks - own
            if extra is not None:
                for spec in specs:
                    more = extra.match(spec.name, namespace, arr, digests)
                    old = found.get(spec.name)
                    if more is not None:
                        found[spec.name] = (
                            more
                            if old is None
                            else ReplicaMatch(
                                spec.name,
                                max(more.blocks, old.blocks),
                                max(more.gpu_blocks, old.gpu_blocks),
                            )
                        )
        known = [s.name for s in eligible if s.capacity_blocks]
        held = self._index.num_blocks_many(known, GPU)
        return _Matches(n, eligible, found, held, arr, chains, store_only)

    def _scores(self, matches: _Matches, *, up_only: bool = False) -> tuple[ReplicaScore, ...]:
        """Scores of the eligible replicas still in the fleet (``up_only``: of those not marked
        down); call with the lock held."""
        out = []
        health = self._health
        any_down = up_only and bool(health.down)
        now = self._clock() if any_down else 0.0
        found, held, store_only = matches.found, matches.held_blocks, matches.store_only
        loads = self._loads.load
        for spec in matches.eligible:
            load = loads.get(spec.name)
            if load is None:  # removed since the lookup began
                continue
            if any_down and health.down and health.is_down(spec.name, now):
                continue
            match = found.get(spec.name)
            blocks, gpu = (match.blocks, match.gpu_blocks) if match is not None else (0, 0)
            out.append(
                ReplicaScore(
                    spec.name,
                    blocks * spec.block_size,
                    gpu * spec.block_size,
                    load[0],
                    load[1],
                    spec.capacity_blocks,
                    held.get(spec.name, 0),
                    store_only.get(spec.name, 0) * spec.block_size,
                )
            )
        return tuple(out)

    def lookup(self, namespace: Namespace, tokens: TokenIds) -> PromptScores:
        """Cached prompt tokens on every replica serving ``namespace``; changes nothing.

        Raises InvalidTokensError, PayloadTooLargeError or UnknownNamespaceError.
        """
        matches = self._matches(namespace, tokens)
        with self._lock:
            self._loads.expire()
            scores = self._scores(matches)
        if not scores:
            raise UnknownNamespaceError(f"no replica serves namespace {namespace.label()}")
        return PromptScores(namespace, matches.prompt_tokens, scores)

    def route(
        self,
        namespace: Namespace,
        tokens: TokenIds,
        request_id: str | None = None,
        *,
        expire: bool = True,
        digests: Sequence[bytes] | None = None,
    ) -> RouteDecision:
        """Choose the replica for a prompt with the router's policy.

        ``digests``: the prompt's block digests (this router's hash algorithm, the namespace's
        seed, the block size every eligible replica shares), when the caller has them already
        (a replay hashes each prompt once); computed here otherwise, or when they do not fit.

        With a ``request_id`` the route counts as load on the chosen replica until
        ``release(request_id)`` (or the in-flight timeout, unless ``expire`` is false: a caller
        that always releases, like the proxy); without one it is a pure decision.
        Replicas marked down are left out. Raises InvalidTokensError, PayloadTooLargeError,
        UnknownNamespaceError, NoHealthyReplicaError, InvalidArgumentError (a bad id) or
        DuplicateRequestError, each before anything changes.
        """
        if request_id is not None and (
            not isinstance(request_id, str)
            or not request_id
            or len(request_id) > MAX_REQUEST_ID_CHARS
        ):
            raise InvalidArgumentError(
                f"request_id must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} "
                f"characters, got {request_id!r}"
            )
        matches = self._matches(namespace, tokens, digests)
        n = matches.prompt_tokens
        with self._lock:
            loads = self._loads
            loads.expire()
            if request_id is not None and request_id in loads.requests:
                raise DuplicateRequestError(f"request {request_id!r} is already in flight")
            scores = self._scores(matches, up_only=True)
            if not scores:
                if self._scores(matches):
                    now = self._clock()
                    back = self._health.back_at(s.name for s in matches.eligible)
                    raise NoHealthyReplicaError(
                        f"every replica serving namespace {namespace.label()} is marked down "
                        "(failed requests or health probes); retry later",
                        retry_after_s=max(0.0, back - now),
                    )
                raise UnknownNamespaceError(f"no replica serves namespace {namespace.label()}")
            if self._tenant_shares:
                scores = self._with_room(namespace, scores)
            eligible = tuple(s.name for s in scores)  # not the namespace: salts are unbounded
            turn = self._turns.get(eligible, 0)
            choice = self._policy(scores, RouteContext(n, turn, self._params))
            self._turns[eligible] = turn + 1
            if request_id is not None:
                # its load is the prefill work it takes on: cached tokens cost it no compute
                work = n - next(s for s in scores if s.name == choice.replica).cached_tokens
                loads.charge(request_id, choice.replica, n, work, self._timeout if expire else None)
        chosen = next(s for s in scores if s.name == choice.replica)
        if self._held is not None or self._observer is not None:
            spec = next(s for s in matches.eligible if s.name == choice.replica)
            digests = matches.digests.get(spec.block_size)
            if digests and self._held is not None:
                self._held.note_route(choice.replica, namespace, matches.tokens, digests)
            if self._observer is not None:
                self._observer(choice.replica, digests or [], n, spec.block_size)
        return RouteDecision(
            choice.replica,
            self._policy_name,
            choice.rule,
            request_id,
            n,
            chosen.cached_tokens,
            chosen.gpu_cached_tokens,
            scores,
        )

    def release(self, request_id: str) -> Released:
        """End an in-flight request: its replica's load drops. UnknownRequestError if the id is
        not in flight (never routed with an id, or released already)."""
        with self._lock:
            self._loads.expire()
            released = self._loads.release(request_id) if isinstance(request_id, str) else None
        if released is None:
            ended = f" (or its load ended after {self._timeout:g} s)" if self._timeout else ""
            raise UnknownRequestError(f"request {request_id!r} is not in flight{ended}")
        return released
