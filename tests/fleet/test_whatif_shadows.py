"""Counterfactual fleets in miniature: with every request sampled, one shadow replica gives
exactly the hits of a cache manager fed the real prompts (the synthesized tokens keep the
sharing the digests show); the scenarios cover N-1, N+1, 2N and every other policy; prefix
routing beats round robin on shared prompts; a request is sampled with its first block."""

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


def test_a_sample_takes_every_request_of_a_sampled_first_block():
    prompts = _prompts()
    spec = ReplicaSpec("a", Namespace("m"), B, 400)
    shadows = ShadowFleets([spec], "prefix", rate=0.3)
    assert shadows.capacity == 120  # 400 blocks x 0.3: the miniature's cache
    rows = _feed(shadows, prompts)
    hasher = BlockHasher(B)
    firsts = [hasher.hash_prompt(p, NS)[0] for p in prompts]
    kept = sum(int.from_bytes(d[:8], "big") < int(0.3 * 2**64) for d in firsts)
    assert rows["as configured"]["requests"] == kept
    assert 0 < kept < len(prompts)
