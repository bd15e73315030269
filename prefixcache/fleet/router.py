"""The fleet router: prompt -> digest chain -> index match -> per-replica scores -> a policy.

``Router`` has no HTTP in it: the service calls it from request handlers, a fleet replay calls it
in process. It is thread-safe: hashing and the index lookup run outside its lock (the index is
written concurrently by the event ingestion and answers on its own), the choice and the load
bookkeeping run under it, so two concurrent routes always see each other's load.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prefixcache.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    NoHealthyReplicaError,
    PayloadTooLargeError,
    UnknownNamespaceError,
    UnknownReplicaError,
    UnknownRequestError,
)
from prefixcache.fleet.fleet_index import GPU, FleetIndex, ReplicaMatch
from prefixcache.fleet.routing import (
    DEFAULT_POLICY,
    Policy,
    ReplicaScore,
    RouteContext,
    RoutingParams,
    check_params,
    get_policy,
)
from prefixcache.hashing import BlockHasher
from prefixcache.namespace import Namespace
from prefixcache.tokens import TokenIds, as_size, as_token_array

MAX_REQUEST_ID_CHARS = 256
ANY_ADAPTER = "*"  # in ReplicaSpec.adapters: every LoRA adapter (loaded at run time)


class ReplicaSpec(NamedTuple):
    """One replica as the router sees it: what it serves and how big its cache is."""

    name: str
    namespace: Namespace  # the namespace its KV events are hashed under
    block_size: int = 16
    capacity_blocks: int = 0  # 0: unknown (then free capacity never decides a route)
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves besides its own (any version);
    # "*" (ANY_ADAPTER): every adapter, as an engine that loads adapters at run time

    def serves(self, namespace: Namespace) -> bool:
        """Whether a request in ``namespace`` may go to this replica: the same model; the
        replica's own adapter (and version, when it has one) or one of ``adapters``; any salt and
        extra keys unless the replica is configured with its own (then those). Salts and extra
        keys are per request in vLLM (``cache_salt``, multimodal hashes), so any replica of the
        model serves them."""
        own = self.namespace
        if namespace.model != own.model:
            return False
        if own.salt is not None and namespace.salt != own.salt:
            return False
        if own.extra and namespace.extra != own.extra:
            return False
        if namespace.adapter == own.adapter:
            return own.adapter_version is None or namespace.adapter_version == own.adapter_version
        adapters = self.adapters
        return namespace.adapter in adapters or (
            namespace.adapter is not None and ANY_ADAPTER in adapters
        )


class Lookup(NamedTuple):
    """Per-replica scores of a prompt, without routing it."""

    namespace: Namespace
    prompt_tokens: int
    scores: tuple[ReplicaScore, ...]  # eligible replicas, in configured order


class RouteDecision(NamedTuple):
    """Where a prompt goes, and why."""

    replica: str
    policy: str
    rule: str  # the rule of the policy that decided (see routing.Choice)
    request_id: str | None  # None: the route was not recorded as load
    prompt_tokens: int
    cached_tokens: int  # on the chosen replica
    gpu_cached_tokens: int
    scores: tuple[ReplicaScore, ...]


class ReplicaLoad(NamedTuple):
    """In-flight requests on one replica and their prompt tokens it has to compute (those it
    did not cache when they were routed: its prefill work)."""

    name: str
    in_flight: int
    in_flight_tokens: int


class ReplicaHealth(NamedTuple):
    """Whether a replica takes routes now."""

    name: str
    up: bool
    down_for_s: float  # seconds until it takes routes again by itself (0 when up)
    reason: str  # why it was marked down ("" when up)
    marked_down: int  # times it went down so far


class Released(NamedTuple):
    """The in-flight request that ``release`` ended."""

    request_id: str
    replica: str
    prompt_tokens: int


class _Matches(NamedTuple):
    """What the index says about a prompt, read before the router's lock is taken."""

    prompt_tokens: int
    eligible: list[ReplicaSpec]  # the replicas serving its namespace
    found: dict[str, ReplicaMatch]  # replica -> its leading cached blocks
    held_blocks: dict[str, int]  # GPU blocks the index holds, for replicas with a known capacity


class _InFlight(NamedTuple):
    replica: str
    tokens: int  # the prompt's
    work: int  # of those, the ones the replica did not cache when routed (its load)
    generation: int  # of the replica when routed: a removed and re-added replica starts afresh
    deadline: float  # on the router's clock: the load ends then if nobody released it


class Router:
    """Scores prompts against a ``FleetIndex`` and routes them with a policy from
    ``routing.POLICIES``, keeping the in-flight load of every replica.

    ``in_flight_timeout`` (seconds on ``clock``; None: never) ends the load of a routed request
    that was never released, e.g. because its client died: without it such loads would skew
    every later choice for good. Expired requests are counted (``expired()``).

    A replica ``mark_down`` (a failed request, a failed health probe) takes no routes until the
    time given passes or ``mark_up``; lookups still score it.
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
    ) -> None:
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
        self._load: dict[str, list[int]] = {}  # name -> [in_flight, in_flight_tokens]
        self._generation: dict[str, int] = {}
        self._next_generation = 0
        self._in_flight: dict[str, _InFlight] = {}
        self._deadlines: deque[tuple[str, _InFlight]] = deque()  # in route order (and deadline)
        self._expired = 0
        self._down: dict[str, tuple[float, str]] = {}  # name -> (up again at, reason)
        self._marked_down: dict[str, int] = {}
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
            self._load[spec.name] = [0, 0]
            self._generation[spec.name] = self._next_generation
            self._next_generation += 1

    def remove_replica(self, name: str) -> ReplicaSpec:
        """Take a replica out of the fleet and out of the index; its in-flight requests can
        still be released. UnknownReplicaError if it is not in the fleet."""
        with self._lock:
            spec = self._specs.pop(name, None) if isinstance(name, str) else None
            if spec is None:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            del self._load[name]
            del self._generation[name]
            self._down.pop(name, None)
            self._marked_down.pop(name, None)
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
            self._expire()
            return [ReplicaLoad(name, *self._load[name]) for name in self._specs]

    def in_flight(self) -> int:
        """Requests routed with an id and not yet released (also those of removed replicas)."""
        with self._lock:
            self._expire()
            return len(self._in_flight)

    def expired(self) -> int:
        """Routed requests whose load ended by the timeout, never released."""
        with self._lock:
            self._expire()
            return self._expired

    def mark_down(self, name: str, seconds: float, reason: str) -> None:
        """Route nothing to replica ``name`` for ``seconds`` (it failed a request or a health
        probe); a later mark extends or shortens it. UnknownReplicaError if not in the fleet."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise InvalidArgumentError(f"seconds must be a positive number, got {seconds!r}")
        with self._lock:
            if name not in self._specs:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            now = self._clock()
            if not self._is_down(name, now):  # counted when it goes down, not while it stays
                self._marked_down[name] = self._marked_down.get(name, 0) + 1
            self._down[name] = (now + seconds, str(reason))

    def mark_up(self, name: str) -> None:
        """Replica ``name`` takes routes again (a health probe succeeded)."""
        with self._lock:
            if name not in self._specs:
                raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
            self._down.pop(name, None)

    def health(self) -> list[ReplicaHealth]:
        """Up or down, per replica, in fleet order."""
        with self._lock:
            now = self._clock()
            out = []
            for name in self._specs:
                until, reason = self._down.get(name, (0.0, ""))
                up = until <= now
                out.append(
                    ReplicaHealth(
                        name,
                        up,
                        0.0 if up else until - now,
                        "" if up else reason,
                        self._marked_down.get(name, 0),
                    )
                )
            return out

    def _is_down(self, name: str, now: float) -> bool:
        entry = self._down.get(name)
        if entry is None:
            return False
        if entry[0] <= now:  # its time is up: it takes routes again
            del self._down[name]
            return False
        return True

    def _expire(self) -> None:
        """End the loads whose deadline has passed; call with the lock held."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = self._clock()
        while deadlines and deadlines[0][1].deadline <= now:
            request_id, entry = deadlines.popleft()
            if self._in_flight.get(request_id) is not entry:  # released (or routed anew)
                continue
            del self._in_flight[request_id]
            self._drop_load(entry)
            self._expired += 1

    def _compact_deadlines(self) -> None:
        """Forget the deadlines of routes released already (they would wait for their time)."""
        in_flight = self._in_flight
        self._deadlines = deque(
            (rid, entry) for rid, entry in self._deadlines if in_flight.get(rid) is entry
        )

    def _drop_load(self, entry: _InFlight) -> None:
        if self._generation.get(entry.replica) == entry.generation:
            load = self._load[entry.replica]
            load[0] -= 1
            load[1] -= entry.work

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

    def _matches(self, namespace: Namespace, tokens: TokenIds) -> _Matches:
        """Everything a route reads from the index, outside the router's lock."""
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
        for block_size, specs in by_size.items():
            hasher = self._hashers[block_size]
            digests = hasher.hash_blocks(arr, hasher.seed(namespace), 0, n // block_size)
            if not digests:
                continue
            wanted = {s.name for s in specs}
            for match in self._index.match(digests):
                if match.replica in wanted:
                    found[match.replica] = match
        known = [s.name for s in eligible if s.capacity_blocks]
        held = self._index.num_blocks_many(known, GPU)
        return _Matches(n, eligible, found, held)

    def _scores(self, matches: _Matches, *, up_only: bool = False) -> tuple[ReplicaScore, ...]:
        """Scores of the eligible replicas still in the fleet (``up_only``: of those not marked
        down); call with the lock held."""
        out = []
        now = self._clock() if up_only and self._down else 0.0
        found, held = matches.found, matches.held_blocks
        for spec in matches.eligible:
            load = self._load.get(spec.name)
            if load is None:  # removed since the lookup began
                continue
            if up_only and self._down and self._is_down(spec.name, now):
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
                )
            )
        return tuple(out)

    def lookup(self, namespace: Namespace, tokens: TokenIds) -> Lookup:
        """Cached prompt tokens on every replica serving ``namespace``; changes nothing.

        Raises InvalidTokensError, PayloadTooLargeError or UnknownNamespaceError.
        """
        matches = self._matches(namespace, tokens)
        with self._lock:
            self._expire()
            scores = self._scores(matches)
        if not scores:
            raise UnknownNamespaceError(f"no replica serves namespace {namespace.label()}")
        return Lookup(namespace, matches.prompt_tokens, scores)

    def route(
        self,
        namespace: Namespace,
        tokens: TokenIds,
        request_id: str | None = None,
        *,
        expire: bool = True,
    ) -> RouteDecision:
        """Choose the replica for a prompt with the router's policy.

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
        matches = self._matches(namespace, tokens)
        n = matches.prompt_tokens
        with self._lock:
            self._expire()
            if request_id is not None and request_id in self._in_flight:
                raise DuplicateRequestError(f"request {request_id!r} is already in flight")
            scores = self._scores(matches, up_only=True)
            if not scores:
                if self._scores(matches):
                    now = self._clock()
                    back = min(
                        self._down[s.name][0] for s in matches.eligible if s.name in self._down
                    )
                    raise NoHealthyReplicaError(
                        f"every replica serving namespace {namespace.label()} is marked down "
                        "(failed requests or health probes); retry later",
                        retry_after_s=max(0.0, back - now),
                    )
                raise UnknownNamespaceError(f"no replica serves namespace {namespace.label()}")
            eligible = tuple(s.name for s in scores)  # not the namespace: salts are unbounded
            turn = self._turns.get(eligible, 0)
            choice = self._policy(scores, RouteContext(n, turn, self._params))
            self._turns[eligible] = turn + 1
            if request_id is not None:
                load = self._load[choice.replica]
                # its load is the prefill work it takes on: cached tokens cost it no compute
                work = n - next(s for s in scores if s.name == choice.replica).cached_tokens
                load[0] += 1
                load[1] += work
                timeout = self._timeout if expire else None
                deadline = math.inf if timeout is None else self._clock() + timeout
                generation = self._generation[choice.replica]
                entry = _InFlight(choice.replica, n, work, generation, deadline)
                self._in_flight[request_id] = entry
                if timeout is not None:
                    self._deadlines.append((request_id, entry))
                    if len(self._deadlines) > 2 * len(self._in_flight) + 1024:
                        self._compact_deadlines()
        chosen = next(s for s in scores if s.name == choice.replica)
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
            self._expire()
            entry = self._in_flight.pop(request_id, None) if isinstance(request_id, str) else None
            if entry is None:
                ended = f" (or its load ended after {self._timeout:g} s)" if self._timeout else ""
                raise UnknownRequestError(f"request {request_id!r} is not in flight{ended}")
            self._drop_load(entry)
        return Released(request_id, entry.replica, entry.tokens)


def pinned_adapter_versions(namespaces: Iterable[Namespace]) -> dict[tuple[str, str], str]:
    """(model, adapter) -> the version a replica dedicated to that adapter pins (the first
    such namespace): the version the adapter has across the fleet, for the router's clients
    and for the ingest of replicas that serve it without pinning one."""
    versions: dict[tuple[str, str], str] = {}
    for ns in namespaces:
        if ns.adapter is not None and ns.adapter_version is not None:
            versions.setdefault((ns.model, ns.adapter), ns.adapter_version)
    return versions


def served_label(spec: ReplicaSpec) -> str:
    """What a replica serves, for error messages."""
    label = spec.namespace.label()
    return f"{label} (+ adapters {', '.join(spec.adapters)})" if spec.adapters else label
