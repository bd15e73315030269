"""Routing policies and the in-process Router, over the in-memory test index."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidTokensError,
    NoHealthyReplicaError,
    PayloadTooLargeError,
    UnknownNamespaceError,
    UnknownReplicaError,
    UnknownRequestError,
)
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.policies import (
    POLICIES,
    ReplicaScore,
    RouteContext,
    RoutingParams,
    get_policy,
    is_imbalanced,
    least_loaded,
    prefix,
    prefix_balanced,
    prefix_cost,
    round_robin,
)
from prefixcache.fleet.replica_load import ReplicaLoad
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.router import Router
from prefixcache.medium import CPU

NS = Namespace("m")


def score(name: str, cached: int = 0, load: int = 0, **kw: int) -> ReplicaScore:
    fields = {"gpu_cached_tokens": cached, "in_flight_tokens": 0, "capacity_blocks": 100}
    fields["held_blocks"] = 0
    fields.update(kw)
    return ReplicaScore(name, cached, in_flight=load, **fields)  # type: ignore[misc]


# ---- policies -----------------------------------------------------------------------------------


def test_round_robin_cycles_in_order() -> None:
    scores = [score("a"), score("b"), score("c")]
    picks = [round_robin(scores, RouteContext(10, turn)).replica for turn in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]


def test_least_loaded_requests_then_tokens_then_order() -> None:
    scores = [score("a", load=2), score("b", load=1, in_flight_tokens=50), score("c", load=1)]
    assert least_loaded(scores, RouteContext(10)).replica == "c"
    assert least_loaded([score("a"), score("b")], RouteContext(10)).replica == "a"


def test_equal_replicas_take_turns() -> None:
    """Ties that load cannot break rotate with the router's turn, for every policy: cold
    prompts spread over the fleet instead of all landing on the first replica."""
    cold = [score("a"), score("b"), score("c")]
    for policy in (least_loaded, prefix, prefix_balanced, prefix_cost):
        picks = [policy(cold, RouteContext(64, turn)).replica for turn in range(4)]
        assert picks == ["a", "b", "c", "a"], policy.__name__
    warm = [score("a"), score("b", 32), score("c")]
    assert {prefix(warm, RouteContext(64, turn)).replica for turn in range(3)} == {"b"}


def test_prefix_most_cached_then_gpu_then_least_loaded() -> None:
    ctx = RouteContext(64)
    assert prefix([score("a", 16), score("b", 48), score("c", 32)], ctx).replica == "b"
    tie = [score("a", 32, load=3), score("b", 32, load=1), score("c", 16)]
    assert prefix(tie, ctx) == ("b", "prefix")
    gpu = [score("a", 32, gpu_cached_tokens=16), score("b", 32, gpu_cached_tokens=32, load=5)]
    assert prefix(gpu, ctx).replica == "b"


def test_prefix_balanced_follows_sglang_rule() -> None:
    params = RoutingParams(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.3)
    ctx = RouteContext(100, 0, params)
    # balanced, good match: the prefix holder wins even though it is busier
    balanced = [score("a", 80, load=4), score("b", 0, load=1)]
    assert prefix_balanced(balanced, ctx) == ("a", "prefix")
    # max - min = 5 > 4 and 6 > 1.5 * 1: imbalanced, the least loaded wins
    imbalanced = [score("a", 80, load=6), score("b", 0, load=1)]
    assert is_imbalanced(imbalanced, params)
    assert prefix_balanced(imbalanced, ctx) == ("b", "imbalanced")
    # a large absolute gap that is not relatively large is still balanced
    relative = [score("a", 80, load=20), score("b", 0, load=15)]
    assert not is_imbalanced(relative, params)
    assert prefix_balanced(relative, ctx).replica == "a"
    # best match 30% is not above the threshold: the roomiest replica wins
    low = [
        score("a", 30, held_blocks=90),
        score("b", 0, held_blocks=10),
        score("c", held_blocks=10),
    ]
    assert prefix_balanced(low, ctx) == ("b", "low_match")
    # a replica of unknown capacity (0): free capacity decides nothing, the least loaded wins
    unknown = [score("a", held_blocks=10, load=2), score("b", held_blocks=90, capacity_blocks=0)]
    assert prefix_balanced(unknown, ctx) == ("b", "low_match")


def test_prefix_cost_weighs_the_prefill_saved_against_the_queue() -> None:
    ctx = RouteContext(1000, 0, RoutingParams(prefill_weight=2.0))
    # a: 800 cached, 1,000 tokens in flight: 2 x 200 + 1,000 = 1,400; b: 2 x 1,000 + 0 = 2,000
    holder, idle = score("a", 800, load=1, in_flight_tokens=1000), score("b")
    assert prefix_cost([holder, idle], ctx) == ("a", "cost")
    # with more queued on the holder, recomputing the prefix elsewhere is cheaper
    busier = holder._replace(in_flight=2, in_flight_tokens=1700)
    assert prefix_cost([busier, idle], ctx) == ("b", "cost")
    # equal cost: more cached on GPU, then the least loaded
    gpu = [score("a", 500, gpu_cached_tokens=0), score("b", 500, gpu_cached_tokens=500, load=3)]
    assert prefix_cost(gpu, ctx).replica == "b"
    even = [score("a", 500, load=2), score("b", 500, load=1)]
    assert prefix_cost(even, ctx).replica == "b"


def test_a_shared_prefix_spreads_under_prefix_cost_but_not_under_prefix() -> None:
    """Every prompt shares a long prefix that one replica holds: ``prefix`` sends them all
    there, ``prefix_cost`` only until that replica's queue outweighs recomputing the prefix."""
    ctx = RouteContext(1100, 0, RoutingParams(prefill_weight=4.0))
    in_flight = {"a": 0, "b": 0}
    for _ in range(40):
        scores = [
            score("a", 1024, load=in_flight["a"], in_flight_tokens=1100 * in_flight["a"]),
            score("b", 0, load=in_flight["b"], in_flight_tokens=1100 * in_flight["b"]),
        ]
        assert prefix(scores, ctx).replica == "a"
        in_flight[prefix_cost(scores, ctx).replica] += 1
    assert in_flight["b"] > 0 and in_flight["a"] - in_flight["b"] <= 4


def test_registry_and_bad_names() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "least_loaded",
        "prefix",
        "prefix_balanced",
        "prefix_cost",
    }
    assert get_policy("prefix") is prefix
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'"):
        get_policy("fastest")
    with pytest.raises(InvalidArgumentError, match="no eligible replica"):
        prefix([], RouteContext(1))


replica_scores = st.lists(
    st.builds(
        ReplicaScore,
        name=st.just(""),
        cached_tokens=st.integers(0, 512),
        gpu_cached_tokens=st.integers(0, 512),
        in_flight=st.integers(0, 200),
        in_flight_tokens=st.integers(0, 10_000),
        capacity_blocks=st.integers(0, 1000),
        held_blocks=st.integers(0, 1000),
    ),
    min_size=1,
    max_size=16,
).map(lambda xs: [x._replace(name=f"r{i}") for i, x in enumerate(xs)])


@given(replica_scores, st.integers(1, 1024), st.integers(0, 1000))
def test_policy_properties(scores: list[ReplicaScore], prompt: int, turn: int) -> None:
    ctx = RouteContext(prompt, turn)
    by_name = {s.name: s for s in scores}
    best_cached = max(s.cached_tokens for s in scores)
    least = min(s.in_flight for s in scores)
    # prefix never picks a replica with fewer cached tokens than another one
    assert by_name[prefix(scores, ctx).replica].cached_tokens == best_cached
    assert by_name[least_loaded(scores, ctx).replica].in_flight == least
    assert round_robin(scores, ctx).replica == scores[turn % len(scores)].name
    choice = prefix_balanced(scores, ctx)
    chosen = by_name[choice.replica]
    if is_imbalanced(scores, ctx.params):
        assert choice.rule == "imbalanced" and chosen.in_flight == least
    elif best_cached / prompt > ctx.params.cache_threshold:
        assert choice.rule == "prefix" and chosen.cached_tokens == best_cached
    else:
        assert choice.rule == "low_match"
        if all(s.capacity_blocks > 0 for s in scores):
            free = max(s.capacity_blocks - s.held_blocks for s in scores)
            assert chosen.capacity_blocks - chosen.held_blocks == free
        else:
            assert chosen.in_flight == least
    # prefix_cost picks a replica of least cost: weighted tokens to prefill plus those in flight
    w = ctx.params.prefill_weight

    def cost(s: ReplicaScore) -> float:
        return w * (prompt - s.cached_tokens) + s.in_flight_tokens

    assert cost(by_name[prefix_cost(scores, ctx).replica]) == min(map(cost, scores))


# ---- router -------------------------------------------------------------------------------------


def seeded(policy: str = "prefix", **kw: object) -> tuple[Router, MemoryFleetIndex, np.ndarray]:
    index = MemoryFleetIndex()
    tokens = np.arange(1, 129, dtype="<i4")  # 8 blocks of 16
    digests = BlockHasher(16).hash_prompt(tokens, NS)
    index.store("a", digests[:2])
    index.store("b", digests[:6])
    index.store("b", digests[6:], CPU)
    index.store("c", [])
    specs = [ReplicaSpec(name, NS, 16, 1000) for name in "abc"]
    return Router(index, specs, policy, **kw), index, tokens  # type: ignore[arg-type]


def test_lookup_scores_every_eligible_replica() -> None:
    router, _, tokens = seeded()
    result = router.lookup(NS, tokens)
    assert result.prompt_tokens == 128
    got = {s.name: (s.cached_tokens, s.gpu_cached_tokens, s.held_blocks) for s in result.scores}
    assert got == {"a": (32, 32, 2), "b": (128, 96, 6), "c": (0, 0, 0)}  # held: on GPU
    assert router.lookup(NS, tokens.tolist()) == result
    assert router.lookup(NS, tokens[:20]).scores[1].cached_tokens == 16
    other = Router(MemoryFleetIndex(), [ReplicaSpec("x", Namespace("m", salt="t"), 16)])
    assert other.lookup(Namespace("m", salt="t"), tokens).scores[0].cached_tokens == 0


def test_a_route_reads_the_digests_its_caller_computed() -> None:
    """``route(digests=...)`` uses the caller's digests of the prompt (a replay hashes a prompt
    once), and hashes itself when they do not fit the prompt."""
    router, _, tokens = seeded()
    digests = BlockHasher(16).hash_prompt(tokens, NS)
    assert router.route(NS, tokens, digests=digests).replica == "b"
    wrong = [bytes(16)] * len(digests)  # digests of another prompt: the index knows none
    assert router.route(NS, tokens, digests=wrong).cached_tokens == 0
    assert router.route(NS, tokens, digests=digests[:3]).cached_tokens == 128  # not this prompt's


def test_cache_hits_in_flight_do_not_push_a_tenant_off_its_replica() -> None:
    # requests in flight that hit the cache cost their replica no prefill: counting their cached
    # tokens as load spread a hot tenant over replicas that had to recompute its prompt
    index = MemoryFleetIndex()
    hasher = BlockHasher(16)
    system = np.arange(1000, 1000 + 16 * 90, dtype="<i4")  # a 1,440-token system prompt
    index.store("a", hasher.hash_prompt(system, NS))
    router = Router(index, [ReplicaSpec(n, NS, 16) for n in "ab"], "prefix_cost")
    for i in range(40):
        question = np.arange(i * 100, i * 100 + 40, dtype="<i4")
        prompt = np.concatenate([system, question])
        assert router.route(NS, prompt, request_id=f"r{i}").replica == "a"
    assert router.loads()[0] == ReplicaLoad("a", 40, 40 * 40)


def test_free_capacity_counts_gpu_blocks_only() -> None:
    # a replica that offloaded blocks to CPU has as much GPU room as before: the low-match
    # fallback of prefix_balanced must not take it for full
    index = MemoryFleetIndex()
    hasher = BlockHasher(16)
    busy_gpu = hasher.hash_prompt(np.arange(1000, 1000 + 16 * 40, dtype="<i4"), NS)
    offloaded = hasher.hash_prompt(np.arange(5000, 5000 + 16 * 90, dtype="<i4"), NS)
    index.store("a", busy_gpu)  # 40 of 100 blocks on GPU
    index.store("b", offloaded[:10])  # 10 on GPU ...
    index.store("b", offloaded[10:], CPU)  # ... and 80 more on CPU
    router = Router(index, [ReplicaSpec(n, NS, 16, 100) for n in "ab"], "prefix_balanced")
    held = {s.name: s.held_blocks for s in router.lookup(NS, np.arange(9, 9 + 64)).scores}
    assert held == {"a": 40, "b": 10}
    assert router.route(NS, np.arange(9, 9 + 64)).replica == "b"


def test_route_counts_load_until_release() -> None:
    router, _, tokens = seeded("prefix")
    longer = np.concatenate([tokens, np.arange(500, 532, dtype="<i4")])  # 2 blocks more
    decision = router.route(NS, longer, request_id="r1")
    assert decision.replica == "b" and decision.cached_tokens == 128
    assert decision.policy == "prefix" and decision.rule == "prefix"
    # the load is the prefill work taken on: the 32 tokens b does not cache
    assert router.loads()[1] == ReplicaLoad("b", 1, 32)
    assert router.in_flight() == 1
    assert router.release("r1") == ("r1", "b", 160)  # the prompt's tokens
    assert router.loads()[1] == ReplicaLoad("b", 0, 0)
    with pytest.raises(UnknownRequestError, match="not in flight"):
        router.release("r1")
    assert router.route(NS, tokens).request_id is None
    assert router.in_flight() == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unreleased_routes_expire() -> None:
    # a client that dies after routing must not hold load on its replica for good
    clock = FakeClock()
    router, _, tokens = seeded("least_loaded", in_flight_timeout=30.0, clock=clock)
    router.route(NS, tokens, request_id="old")  # -> a
    clock.now += 20
    router.route(NS, tokens, request_id="kept")  # -> b
    router.route(NS, tokens, request_id="again")  # -> c
    router.release("again")
    router.route(NS, tokens, request_id="again")  # -> c again; its first deadline is stale
    assert [load.in_flight for load in router.loads()] == [1, 1, 1]
    clock.now += 10  # "old" reaches its deadline
    assert [load.in_flight for load in router.loads()] == [0, 1, 1]
    assert router.in_flight() == 2 and router.expired() == 1
    with pytest.raises(UnknownRequestError, match="ended after 30 s"):
        router.release("old")
    assert router.route(NS, tokens, request_id="old").replica == "a"  # the id is free again
    clock.now += 20  # "kept" and the second "again" end too
    assert router.expired() == 3
    assert [load.in_flight for load in router.loads()] == [1, 0, 0]
    assert router.release("old") == ("old", "a", 128)
    assert router.in_flight() == 0 and router.expired() == 3


def test_routes_the_caller_always_releases_do_not_expire() -> None:
    clock = FakeClock()
    router, _, tokens = seeded("prefix", in_flight_timeout=30.0, clock=clock)
    router.route(NS, tokens, request_id="proxied", expire=False)  # a long stream, say
    clock.now += 1e6
    assert router.in_flight() == 1 and router.expired() == 0
    assert router.release("proxied").replica == "b"


def test_released_routes_do_not_pile_up_waiting_for_their_deadline() -> None:
    router, _, tokens = seeded("prefix", in_flight_timeout=600.0, clock=FakeClock())
    for i in range(5000):
        router.route(NS, tokens, request_id=f"r{i}")
        router.release(f"r{i}")
    assert len(router._loads._deadlines) <= 1025  # compacted, not 5000


def test_routes_never_expire_without_a_timeout() -> None:
    clock = FakeClock()
    router, _, tokens = seeded("prefix", clock=clock)
    router.route(NS, tokens, request_id="r")
    clock.now += 1e9
    assert router.in_flight() == 1 and router.expired() == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_bad_in_flight_timeout(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="in_flight_timeout"):
        Router(MemoryFleetIndex(), [], in_flight_timeout=bad)  # type: ignore[arg-type]


def test_replicas_marked_down_take_no_routes() -> None:
    clock = FakeClock()
    router, _, tokens = seeded("prefix", clock=clock)
    assert router.route(NS, tokens).replica == "b"  # holds the whole prompt
    router.mark_down("b", 10.0, "request failed: ConnectError")
    decision = router.route(NS, tokens, request_id="r")
    assert decision.replica == "a" and {s.name for s in decision.scores} == {"a", "c"}
    assert {s.name for s in router.lookup(NS, tokens).scores} == {"a", "b", "c"}  # still scored
    health = {h.name: h for h in router.health()}
    assert health["b"] == ("b", False, 10.0, "request failed: ConnectError", 1)
    assert health["a"] == ("a", True, 0.0, "", 0)
    router.mark_down("a", 5.0, "probe")
    router.mark_down("c", 4.0, "probe")
    with pytest.raises(NoHealthyReplicaError, match="marked down") as info:
        router.route(NS, tokens, request_id="s")
    assert info.value.retry_after_s == 4.0  # the first one back
    router.mark_down("c", 5.0, "probe")  # still down: not counted again
    assert router.in_flight() == 1  # the refused route changed nothing
    clock.now += 5.0  # a and c are back by themselves
    assert router.route(NS, tokens).replica == "a"
    router.mark_up("b")
    assert router.route(NS, tokens).replica == "b"
    assert [h.marked_down for h in router.health()] == [1, 1, 1]
    with pytest.raises(UnknownReplicaError):
        router.mark_down("zz", 1.0, "x")
    with pytest.raises(UnknownReplicaError):
        router.mark_up("zz")
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(InvalidArgumentError, match="seconds"):
            router.mark_down("a", bad, "x")  # type: ignore[arg-type]
    router.mark_down("a", 1.0, "x")
    router.remove_replica("a")
    assert [h.name for h in router.health()] == ["b", "c"]


def test_least_loaded_spreads_tracked_routes() -> None:
    router, _, tokens = seeded("least_loaded")
    picks = [router.route(NS, tokens, request_id=f"r{i}").replica for i in range(6)]
    # equal request counts: the fewest tokens to compute wins (b caches the whole prompt, a 32 of
    # its 128 tokens, c none)
    assert picks == ["a", "b", "c", "b", "a", "c"]


def test_rejected_routes_change_nothing() -> None:
    router, index, tokens = seeded("prefix", max_prompt_tokens=200)
    router.route(NS, tokens, request_id="held")
    before = (
        router.loads(),
        router.in_flight(),
        index.match(BlockHasher(16).hash_prompt(tokens, NS)),
    )
    bad_calls = [
        (DuplicateRequestError, lambda: router.route(NS, tokens, request_id="held")),
        (InvalidTokensError, lambda: router.route(NS, [1, -1], request_id="x1")),
        (InvalidTokensError, lambda: router.route(NS, [1.5, 2], request_id="x2")),
        (InvalidTokensError, lambda: router.route(NS, [True, 2], request_id="x3")),
        (InvalidTokensError, lambda: router.route(NS, [], request_id="x4")),
        (PayloadTooLargeError, lambda: router.route(NS, list(range(201)), request_id="x5")),
        (UnknownNamespaceError, lambda: router.route(Namespace("n"), tokens, request_id="x6")),
        (InvalidArgumentError, lambda: router.route(NS, tokens, request_id="")),
        (InvalidArgumentError, lambda: router.route("m", tokens)),  # type: ignore[arg-type]
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
        after = (
            router.loads(),
            router.in_flight(),
            index.match(BlockHasher(16).hash_prompt(tokens, NS)),
        )
        assert after == before


def test_namespaces_and_block_sizes_are_kept_apart() -> None:
    index = MemoryFleetIndex()
    tokens = list(range(64))
    lora = Namespace("m", adapter="sql")
    index.store("a", BlockHasher(16).hash_prompt(tokens, NS))
    index.store("big", BlockHasher(32).hash_prompt(tokens, NS))
    index.store("l", BlockHasher(16).hash_prompt(tokens, NS))  # stored under the base namespace
    router = Router(
        index,
        [ReplicaSpec("a", NS, 16), ReplicaSpec("big", NS, 32), ReplicaSpec("l", lora, 16)],
        "prefix",
    )
    got = {s.name: s.cached_tokens for s in router.lookup(NS, tokens).scores}
    assert got == {"a": 64, "big": 64}
    assert [(s.name, s.cached_tokens) for s in router.lookup(lora, tokens).scores] == [("l", 0)]
    assert router.namespaces() == [NS, lora]
    with pytest.raises(UnknownNamespaceError, match="served: m, m lora=sql"):
        router.lookup(Namespace("other"), tokens)


def test_salts_and_listed_adapters_are_served_by_replicas_of_the_model() -> None:
    # vLLM's cache_salt and multimodal keys are per request, and one engine serves many LoRA
    # adapters: such requests may go to any replica of the model that serves the adapter
    index = MemoryFleetIndex()
    tokens = list(range(64))
    salted = Namespace("m", salt="tenant-1")
    sql = Namespace("m", adapter="sql")
    index.store("base", BlockHasher(16).hash_prompt(tokens, salted))  # as its events hash them
    specs = [
        ReplicaSpec("base", NS, 16, adapters=("sql",)),
        ReplicaSpec("plain", NS, 16),
        ReplicaSpec("pinned", Namespace("m", salt="tenant-2"), 16),
        ReplicaSpec("v3", Namespace("m", adapter="chat", adapter_version="3"), 16),
    ]
    router = Router(index, specs, "prefix")
    names = lambda ns: [s.name for s in router.lookup(ns, tokens).scores]  # noqa: E731
    assert names(salted) == ["base", "plain"]
    assert router.lookup(salted, tokens).scores[0].cached_tokens == 64
    assert router.route(salted, tokens).replica == "base"
    assert names(Namespace("m", salt="tenant-2")) == ["base", "plain", "pinned"]
    assert names(sql) == ["base"]
    assert names(Namespace("m", adapter="sql", adapter_version="7")) == ["base"]
    assert names(Namespace("m", adapter="chat", adapter_version="3")) == ["v3"]
    assert names(Namespace("m", extra=("img:1",))) == ["base", "plain"]
    with pytest.raises(UnknownNamespaceError, match=r"m \(\+ adapters sql\)"):
        router.lookup(Namespace("m", adapter="chat", adapter_version="2"), tokens)
    with pytest.raises(InvalidArgumentError, match="adapters"):
        Router(index, [ReplicaSpec("x", NS, 16, adapters=("",))])


def test_replicas_added_and_removed() -> None:
    router, index, tokens = seeded("prefix")
    router.route(NS, tokens, request_id="on-b")
    removed = router.remove_replica("b")
    assert removed.name == "b" and "b" not in index.replicas()
    assert router.route(NS, tokens).replica == "a"
    assert router.release("on-b").replica == "b"  # still releasable
    with pytest.raises(UnknownReplicaError):
        router.remove_replica("b")
    router.add_replica(ReplicaSpec("b", NS, 16, 1000))
    assert router.loads()[-1] == ReplicaLoad("b", 0, 0)
    with pytest.raises(InvalidArgumentError, match="already in the fleet"):
        router.add_replica(ReplicaSpec("a", NS, 16))
    with pytest.raises(InvalidArgumentError, match="block_size"):
        router.add_replica(ReplicaSpec("d", NS, 0))
    assert [s.name for s in router.replicas()] == ["a", "c", "b"]


def test_bad_router_options() -> None:
    with pytest.raises(ConfigError, match="unknown routing policy"):
        Router(MemoryFleetIndex(), [], "nearest")
    with pytest.raises(ConfigError, match="balance_rel_threshold"):
        Router(MemoryFleetIndex(), [], params=RoutingParams(64, 0.5, 0.3))
    with pytest.raises(ConfigError, match="unknown hash"):
        Router(MemoryFleetIndex(), [], hash_algo="md5")


def test_concurrent_routes_releases_and_index_writes() -> None:
    router, index, tokens = seeded("prefix_balanced")
    errors: list[BaseException] = []
    digests = BlockHasher(16).hash_prompt(tokens, NS)

    def client(k: int) -> None:
        try:
            for i in range(150):
                rid = f"{k}-{i}"
                router.route(NS, tokens, request_id=rid)
                router.lookup(NS, tokens)
                router.release(rid)
        except BaseException as exc:
            errors.append(exc)

    def writer() -> None:
        for _ in range(150):
            index.store("c", digests)
            index.remove("c", digests)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert router.in_flight() == 0
    assert all(load.in_flight == 0 and load.in_flight_tokens == 0 for load in router.loads())


def test_the_proxy_names_an_adapter_served_by_any_adapter_replicas() -> None:
    # "*" in adapters serves every adapter; the proxy's model -> namespace step ignored it
    from types import SimpleNamespace

    from prefixcache.fleet.service.openai_proxy.proxy import namespace_for

    router = Router(MemoryFleetIndex(), [ReplicaSpec("a", NS, 16, adapters=("*",))])
    service = SimpleNamespace(router=router)
    ns = namespace_for(service, "sql-lora", "t1")  # type: ignore[arg-type]
    assert ns == Namespace("m", adapter="sql-lora", salt="t1")
    assert router.route(ns, list(range(32))).replica == "a"


def test_the_proxy_does_not_read_a_base_model_name_as_an_adapter() -> None:
    # qwen's only replica wants its own salt; a "*" replica of another model took "qwen-7b" as
    # the name of one of its adapters
    from types import SimpleNamespace

    from prefixcache.fleet.service.openai_proxy.proxy import namespace_for

    router = Router(
        MemoryFleetIndex(),
        [
            ReplicaSpec("llama", Namespace("llama-8b"), 16, adapters=("*",)),
            ReplicaSpec("qwen", Namespace("qwen-7b", salt="tenant1"), 16),
        ],
    )
    service = SimpleNamespace(router=router)
    with pytest.raises(UnknownNamespaceError, match="qwen-7b"):
        namespace_for(service, "qwen-7b", None)  # type: ignore[arg-type]
    assert namespace_for(service, "qwen-7b", "tenant1") == Namespace("qwen-7b", salt="tenant1")  # type: ignore[arg-type]


def test_round_robin_turns_stay_bounded_with_per_request_salts() -> None:
    router = Router(MemoryFleetIndex(), [ReplicaSpec(n, NS, 16) for n in "ab"], "round_robin")
    picked = [router.route(Namespace("m", salt=f"s{k}"), [1] * 16).replica for k in range(100)]
    assert picked[:4] == ["a", "b", "a", "b"]  # one rotation over the same two replicas
    assert len(router._turns) == 1
