"""Routing policies: pure functions that pick one replica from per-replica scores.

Every policy sees the same inputs: one ``ReplicaScore`` per eligible replica (in a fixed order,
the order replicas were configured) and a ``RouteContext`` (prompt length, a turn counter for
round robin, the thresholds). It returns a ``Choice``: the chosen replica's name and the rule that
decided, which metrics and responses report.

- ``round_robin``: the replica at ``turn`` modulo the number of replicas.
- ``least_loaded``: fewest in-flight requests, then fewest in-flight tokens, then the next replica
  in round-robin order (so equal replicas take turns rather than the first one taking all).
- ``prefix``: most cached prompt tokens, then most of them on GPU, then least loaded (as above).
- ``prefix_balanced``: the rule of SGLang's cache-aware router, on in-flight request counts. The
  fleet is *imbalanced* when both ``max - min > balance_abs_threshold`` and
  ``max > balance_rel_threshold * min`` hold over the replicas' in-flight requests; then the least
  loaded replica wins. Otherwise, when the best replica caches more than ``cache_threshold`` of the
  prompt's tokens, ``prefix`` decides; below that, the replica with the most free KV capacity
  (capacity blocks minus the blocks the index holds for it) wins, then least loaded; when some
  replica's capacity is unknown (0), free capacity cannot be compared and least loaded decides.
  The defaults (64 requests, 1.5, 0.3) are SGLang router's.
- ``prefix_cost`` (the default): the least work, as NVIDIA Dynamo's KV router weighs it: the
  prompt tokens the replica would prefill (those it does not cache), times ``prefill_weight``
  (default 8), plus the prompt tokens the requests in flight on it have to compute (those it did
  not cache when they were routed); then most cached on GPU, then least loaded. A shared prefix
  draws requests to the replicas that hold it until their queues cost more than recomputing it;
  ``prefix`` would send them all to one replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from prefixcache.errors import ConfigError, InvalidArgumentError


class ReplicaScore(NamedTuple):
    """What a policy knows about one replica for one prompt."""

    name: str
    cached_tokens: int  # leading prompt tokens the replica holds, any medium
    gpu_cached_tokens: int  # of those, held on GPU
    in_flight: int  # requests routed to it and not yet released
    in_flight_tokens: int  # their prompt tokens to compute (not cached when routed)
    capacity_blocks: int  # KV capacity of the replica, in blocks
    held_blocks: int  # blocks the index holds for the replica on GPU (what capacity bounds)
    store_tokens: int = 0  # of cached_tokens, those in reach only through a shared K/V store


class RoutingParams(NamedTuple):
    """Thresholds of ``prefix_balanced`` (SGLang router's defaults) and the weight of
    ``prefix_cost``."""

    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3
    # a prompt token to prefill here against one queued to prefill: in-flight requests also
    # decode, so a token to compute now weighs more (8 is best or within a few percent of it on
    # the Mooncake traces, the shared system prompt and the tenants workload: BENCHMARKS.md)
    prefill_weight: float = 8.0


class RouteContext(NamedTuple):
    """The per-request inputs a policy may use besides the scores."""

    prompt_tokens: int
    turn: int = 0  # routes made so far by this router; round robin uses it
    params: RoutingParams = RoutingParams()


class Choice(NamedTuple):
    """A policy's answer: the chosen replica and the rule that decided."""

    replica: str
    rule: str  # "round_robin", "least_loaded", "prefix", "imbalanced", "low_match", "cost"


Policy = Callable[[Sequence[ReplicaScore], RouteContext], Choice]


def _load_key(position: int, score: ReplicaScore, turn: int, n: int) -> tuple[int, int, int]:
    # the last tie-break rotates with the router's turn: equal replicas take turns
    return (score.in_flight, score.in_flight_tokens, (position - turn) % n)


def _least_loaded_of(scores: Sequence[ReplicaScore], turn: int) -> ReplicaScore:
    n = len(scores)
    return min(enumerate(scores), key=lambda item: _load_key(item[0], item[1], turn, n))[1]


def _check(scores: Sequence[ReplicaScore]) -> None:
    if not scores:
        raise InvalidArgumentError("no eligible replica to route to")


def round_robin(scores: Sequence[ReplicaScore], ctx: RouteContext) -> Choice:
    """The replica at position ``ctx.turn`` modulo the number of replicas."""
    _check(scores)
    return Choice(scores[ctx.turn % len(scores)].name, "round_robin")


def least_loaded(scores: Sequence[ReplicaScore], ctx: RouteContext) -> Choice:
    """Fewest in-flight requests, then fewest in-flight tokens, then round-robin order."""
    _check(scores)
    return Choice(_least_loaded_of(scores, ctx.turn).name, "least_loaded")


def prefix(scores: Sequence[ReplicaScore], ctx: RouteContext) -> Choice:
    """Most cached prompt tokens, then most on GPU, then fewest only in a shared store (host
    memory before the store), then least loaded."""
    _check(scores)
    n, turn = len(scores), ctx.turn
    best = min(
        enumerate(scores),
        key=lambda item: (
            -item[1].cached_tokens,
            -item[1].gpu_cached_tokens,
            item[1].store_tokens,
            *_load_key(item[0], item[1], turn, n),
        ),
    )[1]
    return Choice(best.name, "prefix")


def is_imbalanced(scores: Sequence[ReplicaScore], params: RoutingParams) -> bool:
    """SGLang's test over in-flight requests: ``max - min > abs`` and ``max > rel * min``."""
    loads = [s.in_flight for s in scores]
    hi, lo = max(loads), min(loads)
    return hi - lo > params.balance_abs_threshold and hi > params.balance_rel_threshold * lo


def prefix_balanced(scores: Sequence[ReplicaScore], ctx: RouteContext) -> Choice:
    """``prefix`` while the fleet is balanced and the best match is large enough; else load or
    free capacity decides (see the module docstring for the exact rule)."""
    _check(scores)
    if is_imbalanced(scores, ctx.params):
        return Choice(_least_loaded_of(scores, ctx.turn).name, "imbalanced")
    best_cached = max(s.cached_tokens for s in scores)
    if ctx.prompt_tokens > 0 and best_cached / ctx.prompt_tokens > ctx.params.cache_threshold:
        return Choice(prefix(scores, ctx).replica, "prefix")
    n, turn = len(scores), ctx.turn
    known = all(s.capacity_blocks > 0 for s in scores)  # else free capacity cannot be compared
    roomiest = min(
        enumerate(scores),
        key=lambda item: (
            item[1].held_blocks - item[1].capacity_blocks if known else 0,
            *_load_key(item[0], item[1], turn, n),
        ),
    )[1]
    return Choice(roomiest.name, "low_match")


def prefix_cost(scores: Sequence[ReplicaScore], ctx: RouteContext) -> Choice:
    """Fewest prompt tokens to prefill (weighted) plus in-flight prompt tokens; then most cached
    on GPU, then fewest only in a shared store, then least loaded."""
    _check(scores)
    n, turn, weight = len(scores), ctx.turn, ctx.params.prefill_weight
    best = min(
        enumerate(scores),
        key=lambda item: (
            weight * (ctx.prompt_tokens - item[1].cached_tokens) + item[1].in_flight_tokens,
            -item[1].gpu_cached_tokens,
            item[1].store_tokens,
            *_load_key(item[0], item[1], turn, n),
        ),
    )[1]
    return Choice(best.name, "cost")


DEFAULT_POLICY = "prefix_cost"

POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix": prefix,
    "prefix_balanced": prefix_balanced,
    "prefix_cost": prefix_cost,
}


def get_policy(name: str) -> Policy:
    """The policy registered under ``name``; ConfigError naming the choices otherwise."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown routing policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None


def check_params(params: RoutingParams) -> RoutingParams:
    """``params`` if every threshold is in range, else ConfigError saying which is not."""
    abs_t, rel_t, cache_t, weight = params
    if isinstance(abs_t, bool) or not isinstance(abs_t, int) or abs_t < 0:
        raise ConfigError(f"balance_abs_threshold must be an integer >= 0, got {abs_t!r}")
    if isinstance(rel_t, bool) or not isinstance(rel_t, int | float) or not 1.0 <= rel_t < math.inf:
        raise ConfigError(f"balance_rel_threshold must be a finite number >= 1, got {rel_t!r}")
    if isinstance(cache_t, bool) or not isinstance(cache_t, int | float) or not 0 <= cache_t <= 1:
        raise ConfigError(f"cache_threshold must be a number in [0, 1], got {cache_t!r}")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not 0 <= weight < math.inf
    ):
        raise ConfigError(f"prefill_weight must be a finite number >= 0, got {weight!r}")
    return RoutingParams(abs_t, float(rel_t), float(cache_t), float(weight))
