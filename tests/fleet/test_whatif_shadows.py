"""Counterfactual fleets in miniature: with every request sampled, one shadow replica gives
exactly the hits of a cache manager fed the real prompts (the synthesized tokens keep the
sharing the digests show); the scenarios cover N-1, N+1, 2N and every other policy; prefix
routing beats round robin on shared prompts; every request is sampled block by block, so a
system prompt all requests share no longer takes the whole sample in or out; a shared prefix
wholly outside the sample is flagged; the miniatures say when they are too small."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache import CacheManager, Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.shadow_fleets import ShadowFleets, scenarios

B = 16
NS = Namespace("m", salt="tenant:acme")


def _prompts(n: int = 600) -> list[list[int]]:
    rng = np.random.default_rng(2)
    systems = [rng.integers(1, 40_000, B * int(rng.integers(2, 10))).tolist() for _ in range(40)]
    weights = 1 / np.arange(1, 41)
    weights /= weights.sum()
    return [
        systems[int(s)] + rng.integers(1, 40_000, int(rng.integers(3, 40))).tolist()
        for s in rng.choice(40, size=n, p=weights)
    ]


def _feed(shadows: ShadowFleets, prompts: list[list[int]]) -> dict[str, dict]:
    hasher = BlockHasher(B)
    for p in prompts:
        shadows.offer(hasher.hash_prompt(p, NS), len(p))
    return {row["scenario"]: row for row in shadows.snapshot()}


def test_one_shadow_replica_is_exactly_a_manager_on_the_real_prompts():
    prompts = _prompts()
    spec = ReplicaSpec("a", Namespace("m"), B, 120)
    rows = _feed(ShadowFleets([spec], "prefix", rate=1.0), prompts)
    mgr = CacheManager(120, B)
    for i, p in enumerate(prompts):
        mgr.admit(i, p, NS)
        mgr.release(i)
    assert rows["as configured"]["requests"] == len(prompts)
    assert rows["as configured"]["token_hit_rate"] == pytest.approx(
        mgr.stats.token_hit_rate,
        abs=1e-6,  # the answer is rounded to 6 digits
    )


def test_the_scenarios_and_what_routing_is_worth():
    assert [s.name for s in scenarios(3, "prefix")] == [
        "as configured", "N-1 replicas", "N+1 replicas", "2N replicas",
        "policy round_robin", "policy least_loaded", "policy prefix_balanced", "policy prefix_cost",
    ]  # fmt: skip
    assert [s.replicas for s in scenarios(1, "prefix")][:3] == [1, 2, 2]  # no N-1 of one
    specs = [ReplicaSpec(f"r{i}", Namespace("m"), B, 60) for i in range(4)]
    rows = _feed(ShadowFleets(specs, "prefix", rate=1.0), _prompts())
    assert rows["as configured"]["token_hit_rate"] > rows["policy round_robin"]["token_hit_rate"]
    # twice the replicas, twice the cache in all: more hits, never fewer
    assert rows["2N replicas"]["token_hit_rate"] >= rows["as configured"]["token_hit_rate"]


def _sampled(digest: bytes, rate: float) -> bool:
    return int.from_bytes(digest[:8], "big") < int(rate * 2**64)


def test_every_request_is_cut_down_to_its_sampled_blocks():
    prompts = _prompts()
    spec = ReplicaSpec("a", Namespace("m"), B, 400)
    shadows = ShadowFleets([spec], "prefix", rate=0.3)
    assert shadows.capacity == 120  # 400 blocks x 0.3: the miniature's cache
    rows = _feed(shadows, prompts)
    hasher = BlockHasher(B)
    kept = [[d for d in hasher.hash_prompt(p, NS) if _sampled(d, 0.3)] for p in prompts]
    report = shadows.report()
    assert report["routed_requests"] == len(prompts)
    assert report["sampled_blocks"] == sum(map(len, kept))
    assert report["sampled_requests"] == sum(1 for k in kept if k)
    assert rows["as configured"]["requests"] == report["sampled_requests"]
    full = sum(len(p) // B * B for p in prompts) / sum(map(len, prompts))
    assert 0 < rows["as configured"]["token_hit_rate"] <= full  # only full blocks hit


def _one_system_prompt(salt: str, n: int = 400) -> tuple[Namespace, list[list[int]]]:
    """Conversations of 2-6 turns behind one system prompt of 12 blocks, interleaved."""
    rng = np.random.default_rng(5)
    system = rng.integers(1, 40_000, 12 * B).tolist()
    convs: list[list[int]] = []
    prompts = []
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(list(system))
        c = convs[int(rng.integers(len(convs)))]
        c += rng.integers(1, 40_000, int(rng.integers(20, 80))).tolist()
        prompts.append(list(c))
    return Namespace("m", salt=salt), prompts


def test_a_system_prompt_every_request_shares_is_not_all_or_nothing():
    # a salt under which the shared first block falls outside a 30% sample: sampling whole
    # requests by their first block then sees nothing at all (the answer was None)
    hasher = BlockHasher(B)
    salt = next(
        f"s{i}"
        for i in range(100)
        if not _sampled(
            hasher.hash_prompt(_one_system_prompt(f"s{i}", 1)[1][0], Namespace("m", salt=f"s{i}"))[
                0
            ],
            0.3,
        )
    )
    ns, prompts = _one_system_prompt(salt)
    spec = ReplicaSpec("a", Namespace("m"), B, 1000)
    exact = ShadowFleets([spec], "prefix", rate=1.0)
    sampled = ShadowFleets([spec], "prefix", rate=0.3)
    for p in prompts:
        digests = hasher.hash_prompt(p, ns)
        exact.offer(digests, len(p))
        sampled.offer(digests, len(p))
    truth = exact.snapshot()[0]["token_hit_rate"]
    row = sampled.snapshot()[0]
    assert sampled.report()["sampled_requests"] == len(prompts)  # every request has a block in
    assert 0.5 < truth < 1
    assert abs(row["token_hit_rate"] - truth) < max(0.03, 3 * row["stderr"])


def test_a_shared_prefix_wholly_outside_the_sample_is_flagged():
    hasher = BlockHasher(B)
    spec = ReplicaSpec("a", Namespace("m"), B, 4000)

    def system_sampled(salt: str) -> int:
        ns, prompts = _one_system_prompt(salt, 1)
        return sum(_sampled(d, 0.05) for d in hasher.hash_prompt(prompts[0], ns)[:12])

    salts = [f"s{i}" for i in range(100)]
    missed = next(s for s in salts if system_sampled(s) == 0)
    kept = next(s for s in salts if system_sampled(s) > 0)
    for salt, flagged in ((missed, True), (kept, False)):
        ns, prompts = _one_system_prompt(salt)
        shadows = ShadowFleets([spec], "prefix", rate=0.05)
        for p in prompts:
            shadows.offer(hasher.hash_prompt(p, ns), len(p))
        report = shadows.report()
        assert report["shared_prefix_unsampled"] is flagged, salt
        assert report["too_small"] is False  # 200 blocks, room for many miniature prompts


def test_too_small_below_the_floor_never_at_full_rate():
    hasher = BlockHasher(B)
    prompts = _prompts(50)
    small = ShadowFleets([ReplicaSpec("a", Namespace("m"), B, 1000)], "prefix", rate=0.1)
    full = ShadowFleets([ReplicaSpec("a", Namespace("m"), B, 20)], "prefix", rate=1.0)
    for p in prompts:
        small.offer(hasher.hash_prompt(p, NS), len(p))
        full.offer(hasher.hash_prompt(p, NS), len(p))
    assert small.capacity == 100 and small.report()["too_small"]  # under 128 blocks
    assert not full.report()["too_small"]  # the real size: what it shows is the real thing


def test_top_share_counts_the_most_common_key_in_bounded_slots():
    from prefixcache.fleet.whatif.shadow_fleets import _TopShare

    top = _TopShare(slots=4)
    assert top.share() == 0.0
    for i in range(100):
        top.add(b"hot" if i % 2 else bytes([i]))  # half one key, half distinct ones
    assert len(top.counts) == 4
    assert 0.5 <= top.share() <= 0.5 + 1 / 4  # over by at most one slot's share
