"""`GET /v1/whatif`: the prompts the service routes, sampled, give each replica's hit rate with
more or less KV memory and the fleet's as one cache. With every block sampled the curves equal
an exact LRU of the prompts each replica got; the metrics export the points; tenant keys see
nothing; a bad `whatif` section is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import ConfigError
from prefixcache.fleet.service.configuration.config_file import parse_config
from tests.fleet.service.serve_harness import round_robin_app
from tests.fleet_support import exact_prefix_lru

MODEL = "m"
BLOCK = 4
CAPACITY = 40
ACME = "sk-acme-0123456789abcdef0000"
OPS = "sk-operator-0123456789abcdef"


def _prompts(n: int = 400) -> list[list[int]]:
    rng = np.random.default_rng(3)
    systems = [
        rng.integers(1, 10_000, BLOCK * int(rng.integers(3, 12))).tolist() for _ in range(30)
    ]
    return [
        systems[int(rng.integers(0, 30))]
        + rng.integers(1, 10_000, int(rng.integers(2, 9))).tolist()
        for _ in range(n)
    ]


def _lru(prompts: list[list[int]], capacity: int) -> float:
    hasher = BlockHasher(BLOCK)
    chains = [hasher.hash_prompt(p, Namespace(MODEL)) for p in prompts]
    return exact_prefix_lru(chains, [len(p) for p in prompts], capacity, BLOCK)


def _client(tmp_path: Path, whatif: dict) -> TestClient:
    (tmp_path / "keys.yaml").write_text(f"{ACME}: acme\n{OPS}: {{role: operator, name: ops}}\n")
    auth = {"keys_file": "keys.yaml"}
    return TestClient(round_robin_app(tmp_path, BLOCK, CAPACITY, auth=auth, whatif=whatif))


def test_curves_of_routed_prompts_equal_exact_lru_with_every_block_sampled(tmp_path: Path):
    prompts = _prompts()
    routed: dict[str, list[list[int]]] = {"a": [], "b": []}
    ops = {"authorization": f"Bearer {OPS}"}
    with _client(tmp_path, {"rate": 1.0}) as client:
        for p in prompts:
            r = client.post("/v1/route", json={"model": MODEL, "tokens": p}, headers=ops)
            routed[r.json()["replica"]].append(p)
        body = client.get("/v1/whatif", headers=ops).json()
        metrics = client.get("/metrics", headers=ops).text
        denied = client.get("/v1/whatif", headers={"authorization": f"Bearer {ACME}"})
    assert body["window"]["routed_requests"] == len(prompts)
    assert body["sampling"]["rate"] == 1.0 and body["factors"] == [0.25, 0.5, 1, 2, 4, 8]
    rows = {row["name"]: row for row in body["replicas"]}
    for name in ("a", "b"):
        row = rows[name]
        assert row["requests"] == len(routed[name]) and row["rate"] == 1.0
        for point in row["points"]:
            exact = _lru(routed[name], point["blocks"])
            assert point["token_hit_rate"] == pytest.approx(exact, abs=0.01), (name, point)
        rates = [p["token_hit_rate"] for p in row["points"]]
        assert rates == sorted(rates) and rates[-1] > rates[0]
    fleet = body["fleet"]
    assert fleet["capacity_blocks"] == 2 * CAPACITY and fleet["replicas"] == 2
    for point in fleet["points"]:  # the pooled line: one cache of both, in arrival order
        assert point["token_hit_rate"] == pytest.approx(_lru(prompts, point["blocks"]), abs=0.01)
    # one cache of both beats either replica alone at the same total memory
    one = next(p for p in fleet["points"] if p["factor"] == 1.0)["token_hit_rate"]
    assert one >= max(next(p for p in rows[n]["points"] if p["factor"] == 1.0)["token_hit_rate"]
                      for n in ("a", "b")) - 0.01  # fmt: skip
    assert 'prefixcache_whatif_token_hit_rate{curve="fleet",factor="8"}' in metrics
    assert 'prefixcache_whatif_token_hit_rate{curve="a",factor="0.25"}' in metrics
    assert denied.status_code == 403
    assert fleet["mixed_block_sizes"] is None
    assert body["counterfactuals"]["state"] == "idle"  # replays run when asked for


def test_curves_off_and_bad_settings(tmp_path: Path):
    ops = {"authorization": f"Bearer {OPS}"}
    with _client(tmp_path, {"enabled": False}) as client:
        client.post("/v1/route", json={"model": MODEL, "tokens": list(range(1, 30))}, headers=ops)
        body = client.get("/v1/whatif", headers=ops).json()
    assert not body["enabled"] and body["window"]["routed_requests"] == 0
    base = {"replicas": [{"name": "a", "model": MODEL, "block_size": BLOCK}]}
    for whatif, where in (
        ({"rate": 0}, "whatif.rate"),
        ({"rate": 1.5}, "whatif.rate"),
        ({"max_memory_mib": -1}, "whatif.max_memory_mib"),
        ({"enabled": "yes"}, "whatif.enabled"),
        ({"sample": 1}, "sample"),
        ({"counterfactual_rate": 0.01}, "whatif.counterfactual_rate.*record_trace"),
    ):
        with pytest.raises(ConfigError, match=where):
            parse_config({**base, "whatif": whatif}, "fleet.yaml", tmp_path)
    # a config written for the shadow fleets, with them off, still loads
    parse_config({**base, "whatif": {"counterfactual_rate": 0}}, "fleet.yaml", tmp_path)


def test_the_rate_reported_is_the_one_sampling_runs_at(tmp_path: Path):
    """A memory bound lowers the curves' sampling as they fill: `/v1/whatif` and the metrics say
    the rate each curve runs at now, and the rate asked for under its own name."""
    ops = {"authorization": f"Bearer {OPS}"}
    rng = np.random.default_rng(8)
    with _client(tmp_path, {"rate": 0.5, "max_memory_mib": 0.5}) as client:
        for _ in range(300):  # about 3,000 distinct blocks: far past 256 sampled a curve
            tokens = rng.integers(1, 10_000, BLOCK * 10 + 1).tolist()
            client.post("/v1/route", json={"model": MODEL, "tokens": tokens}, headers=ops)
        body = client.get("/v1/whatif", headers=ops).json()
        metrics = client.get("/metrics", headers=ops).text
    sampling = body["sampling"]
    assert sampling["requested_rate"] == 0.5
    rows = [*body["replicas"], body["fleet"]]
    assert all(row["sampled_blocks"] <= sampling["max_sampled_blocks_per_curve"] for row in rows)
    assert all(row["rate"] < 0.5 for row in rows)
    assert sampling["rate"] == min(row["rate"] for row in rows) and sampling["rate_lowered"]
    for row in rows:
        line = f'prefixcache_whatif_sampling_rate{{curve="{row["name"]}"}} '
        gauge = float(next(x for x in metrics.splitlines() if x.startswith(line)).split()[-1])
        assert gauge == pytest.approx(row["rate"], rel=1e-6), row["name"]
    assert "prefixcache_whatif_requested_sampling_rate 0.5" in metrics


def test_a_sample_too_small_to_answer_gives_no_figure(tmp_path: Path):
    """128-token blocks and 300 requests that share a 15-block document: at 1% a curve holds
    a handful of sampled blocks (often none), which cannot tell a hit rate of 0.87 from 0: no
    point reads as a figure, the row says why, and the metrics leave the points out. Every
    block sampled, the same traffic answers."""
    ops = {"authorization": f"Bearer {OPS}"}
    rng = np.random.default_rng(12)
    document = rng.integers(1, 30_000, 15 * 128).tolist()
    prompts = [document + rng.integers(1, 30_000, 200).tolist() for _ in range(300)]
    (tmp_path / "small").mkdir()
    (tmp_path / "full").mkdir()
    small_app = round_robin_app(tmp_path / "small", 128, 64, whatif={"rate": 0.01})
    full_app = round_robin_app(tmp_path / "full", 128, 64, whatif={"rate": 1.0})
    with TestClient(small_app) as small, TestClient(full_app) as full:
        for p in prompts:
            for client in (small, full):
                client.post("/v1/route", json={"model": MODEL, "tokens": p}, headers=ops)
        body = small.get("/v1/whatif", headers=ops).json()
        metrics = small.get("/metrics", headers=ops).text
        answered = full.get("/v1/whatif", headers=ops).json()
    for row in [*body["replicas"], body["fleet"]]:
        assert row["sampled_blocks"] < row["min_sampled_blocks"], row
        assert row["too_few_sampled"], row
        assert row["points"] and all(
            p["token_hit_rate"] is None and p["stderr"] is None for p in row["points"]
        ), row
    assert "prefixcache_whatif_token_hit_rate{" not in metrics
    for row in [*answered["replicas"], answered["fleet"]]:
        assert not row["too_few_sampled"]
        at_1x = next(p for p in row["points"] if p["factor"] == 1.0)
        assert at_1x["token_hit_rate"] > 0.8 and at_1x["stderr"] == 0.0
