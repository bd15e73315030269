"""`POST /v1/whatif/counterfactuals`: the service replays the trace it records (every rotated
file of it) with `prefixcache replay` for N-1, N+1, 2N replicas and each other policy, off the
route path, and `GET /v1/whatif/counterfactuals` (and `/v1/whatif`) answers each scenario's hit
rate: the same figure the documented replay command gives on the recorded trace, and for the
fleet as configured (round robin, no load) an exact LRU of each replica's prompts. Without a
trace, with a tenant key, with a bad body or while a replay runs, the answer is a 4xx that
changes nothing; the service's stop ends a replay that runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import ConfigError
from prefixcache.fleet.policies import POLICIES
from prefixcache.fleet.service.configuration.config_file import parse_config
from tests.fleet.service.serve_harness import make_app, serving
from tests.fleet_support import exact_prefix_lru, wait_until

MODEL = "m"
BLOCK = 4
CAPACITY = 24
OPS = "sk-operator-0123456789abcdef"
ACME = "sk-acme-0123456789abcdef0000"
REPLAY_S = 300.0  # a generous bound for one job of a few hundred requests on a busy machine


def _config(tmp_path: Path, **sections: Any) -> Any:
    (tmp_path / "keys.yaml").write_text(f"{ACME}: acme\n{OPS}: {{role: operator, name: ops}}\n")
    data = {
        "routing": {"policy": "round_robin"},
        "auth": {"keys_file": "keys.yaml"},
        "health": {"probe_interval_s": None},
        "replicas": [
            {"name": n, "model": MODEL, "block_size": BLOCK, "capacity_blocks": CAPACITY}
            for n in ("a", "b")
        ],
        **sections,
    }
    return parse_config(data, "fleet.yaml", tmp_path)


def _prompts(n: int) -> list[list[int]]:
    """Prompts of a few shared system prompts and a private tail, each one token past a whole
    block (the replay's one output token then completes no block)."""
    rng = np.random.default_rng(4)
    systems = [rng.integers(1, 10_000, BLOCK * int(rng.integers(2, 7))).tolist() for _ in range(6)]
    return [
        systems[int(rng.integers(0, 6))]
        + rng.integers(1, 10_000, BLOCK * int(rng.integers(0, 4)) + 1).tolist()
        for _ in range(n)
    ]


def _route_all(client: httpx.Client, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    routed: dict[str, list[list[int]]] = {"a": [], "b": []}
    for p in prompts:
        r = client.post("/v1/route", json={"model": MODEL, "tokens": p})
        assert r.status_code == 200, r.text
        routed[r.json()["replica"]].append(p)
    return routed


def _finished(client: httpx.Client) -> dict[str, Any]:
    answers: list[dict[str, Any]] = []

    def done() -> bool:
        answers.append(client.get("/v1/whatif/counterfactuals").json())
        return answers[-1]["state"] != "running"

    wait_until(done, "the counterfactual replay to finish", REPLAY_S)
    return answers[-1]


def _replayed(trace: Path, replicas: int, policy: str, tmp: Path) -> float:
    """The documented command over the recorded trace: its token hit rate."""
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache", "replay", str(trace), "--mode", "serving",
         "--replicas", str(replicas), "--routing", policy, "--blocks", str(CAPACITY),
         "--block-size", str(BLOCK), "--trace-block-size", str(BLOCK), "--output-len", "1",
         "--time-scale", "1000", "--model", "llama-3.1-8b", "--format", "json",
         "--no-progress", "--out", str(tmp)],
        capture_output=True, text=True, check=True, timeout=REPLAY_S,
    )  # fmt: skip
    return float(json.loads(out.stdout)["token_hit_rate"])


def test_counterfactuals_replay_the_recorded_window(tmp_path: Path) -> None:
    record = {"path": "routed.jsonl", "max_mib": 0.01, "keep": 20}  # rotated every ~10 KB
    config = _config(tmp_path, record_trace=record)
    app, _ = make_app(config)
    prompts = _prompts(240)
    ops = {"authorization": f"Bearer {OPS}"}
    with serving(app, config) as base, httpx.Client(base_url=base, headers=ops) as client:
        idle = client.get("/v1/whatif/counterfactuals").json()
        routed = _route_all(client, prompts)
        started = client.post("/v1/whatif/counterfactuals")
        again = client.post("/v1/whatif/counterfactuals")  # the first is still starting up
        answer = _finished(client)
        whatif = client.get("/v1/whatif").json()
    assert idle["state"] == "idle" and idle["scenarios"] == []
    assert started.status_code == 202, started.text
    assert started.json()["state"] == "running"
    assert again.status_code == 409 and "runs already" in again.json()["error"]["message"]
    assert answer["state"] == "done", answer
    assert answer["window_requests"] == len(prompts)  # every rotated file, oldest first
    assert len(list(tmp_path.glob("routed.jsonl.*"))) >= 2
    assert answer["capacity_blocks"] == CAPACITY and answer["block_size"] == BLOCK
    assert whatif["counterfactuals"] == answer
    rows = {row["scenario"]: row for row in answer["scenarios"]}
    others = {f"policy {p}" for p in POLICIES if p != "round_robin"}
    assert set(rows) == {"as configured", "N-1 replicas", "N+1 replicas", "2N replicas"} | others
    assert all(row["token_hit_rate"] is not None and row["seconds"] > 0 for row in rows.values())
    # the fleet as configured, with no load: an exact LRU on each replica of its prompts (the
    # replay's replicas also hold each prompt's partial last block while it runs, a block less
    # for the cache than an LRU of whole blocks has: 1.1 points here)
    hasher = BlockHasher(BLOCK)
    hits = 0.0
    for name in ("a", "b"):
        chains = [hasher.hash_prompt(p, Namespace(MODEL)) for p in routed[name]]
        lengths = [len(p) for p in routed[name]]
        hits += exact_prefix_lru(chains, lengths, CAPACITY, BLOCK) * sum(lengths)
    exact = hits / sum(len(p) for p in prompts)
    assert rows["as configured"]["token_hit_rate"] == pytest.approx(exact, abs=0.02)
    # and each scenario is what the documented command gives on the recorded trace
    trace = tmp_path / "whole.jsonl"
    parts = sorted(tmp_path.glob("routed.jsonl.*"), key=lambda p: -int(p.suffix[1:]))
    trace.write_bytes(b"".join(p.read_bytes() for p in [*parts, tmp_path / "routed.jsonl"]))
    for name in ("2N replicas", "policy prefix"):
        row = rows[name]
        by_hand = _replayed(trace, row["replicas"], row["policy"], tmp_path / name)
        assert row["token_hit_rate"] == pytest.approx(by_hand, abs=1e-6), name
    # keeping the cache of each system prompt on one replica beats spreading them
    assert rows["policy prefix"]["token_hit_rate"] > rows["as configured"]["token_hit_rate"]


def test_chosen_scenarios_and_what_is_refused(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    (tmp_path / "traced").mkdir()
    bare = _config(tmp_path / "none")  # no trace recorded
    traced = _config(tmp_path / "traced", record_trace={"path": "routed.jsonl"})
    ops = {"authorization": f"Bearer {OPS}"}
    acme = {"authorization": f"Bearer {ACME}"}
    path = "/v1/whatif/counterfactuals"
    with serving(make_app(bare)[0], bare) as base, httpx.Client(base_url=base) as client:
        no_trace = client.post(path, headers=ops)
        assert client.get(path, headers=ops).json()["state"] == "idle"
    assert no_trace.status_code == 409
    assert "--record-trace" in no_trace.json()["error"]["message"]
    app = make_app(traced)[0]
    with serving(app, traced) as base, httpx.Client(base_url=base, headers=ops) as client:
        denied = client.post(path, headers=acme)
        denied_read = client.get(path, headers=acme)
        _route_all(client, _prompts(40))
        bad = [
            client.post(path, json=body)
            for body in (
                {"scenarios": [{"replicas": 3, "policy": "fastest"}]},
                {"scenarios": [{"replicas": 0}]},
                {"scenarios": []},
                {"scenarios": [{"replicas": 2, "rate": 1}]},
            )
        ]
        malformed = client.post(path, content=b"{not json")
        unchanged = client.get(path).json()
        scenarios = [{"replicas": 3}, {"replicas": 1, "policy": "prefix"}]
        chosen = client.post(path, json={"scenarios": scenarios})
        answer = _finished(client)
    assert denied.status_code == 403 and denied_read.status_code == 403
    assert [r.status_code for r in bad] == [422, 422, 422, 422], [r.text for r in bad]
    assert "fastest" in bad[0].json()["error"]["message"]
    assert malformed.status_code == 400
    assert unchanged["state"] == "idle"
    assert chosen.status_code == 202, chosen.text
    assert answer["state"] == "done" and answer["window_requests"] == 40
    assert [(r["scenario"], r["replicas"], r["policy"]) for r in answer["scenarios"]] == [
        ("3 replicas, round_robin", 3, "round_robin"),
        ("1 replicas, prefix", 1, "prefix"),
    ]


def test_the_service_stop_ends_a_running_replay(tmp_path: Path) -> None:
    config = _config(tmp_path, record_trace={"path": "routed.jsonl"})
    app, _ = make_app(config)
    ops = {"authorization": f"Bearer {OPS}"}
    jobs = app.state.service.observers.counterfactuals
    pids: list[int] = []
    with serving(app, config) as base, httpx.Client(base_url=base, headers=ops) as client:
        _route_all(client, _prompts(40))
        assert client.post("/v1/whatif/counterfactuals").status_code == 202

        def replaying() -> bool:
            process = jobs._process
            if process is not None:
                pids.append(process.pid)
            return bool(pids)

        wait_until(replaying, "a replay process to start", REPLAY_S)
    # the app has stopped: the replay it ran is gone, and the job says it did not finish
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
    assert jobs.report()["state"] == "failed"


def test_replicas_of_two_block_sizes(tmp_path: Path) -> None:
    """A trace's ids are blocks of one size: recording is refused for replicas of two; the live
    curves answer per replica, and the fleet's line (one cache of two block sizes) says why it
    has no points."""
    replicas = [
        {"name": "small", "model": MODEL, "block_size": 4, "capacity_blocks": 40},
        {"name": "large", "model": MODEL, "block_size": 8, "capacity_blocks": 20},
    ]
    recording = parse_config(
        {"replicas": replicas, "record_trace": {"path": "t.jsonl"}}, "fleet.yaml", tmp_path
    )
    with pytest.raises(ConfigError, match="one block size"):
        make_app(recording)
    config = parse_config(
        {"replicas": replicas, "routing": {"policy": "round_robin"}, "whatif": {"rate": 1.0}},
        "fleet.yaml",
        tmp_path,
    )
    app, _ = make_app(config)
    with serving(app, config) as base, httpx.Client(base_url=base) as client:
        for p in _prompts(60):
            assert client.post("/v1/route", json={"model": MODEL, "tokens": p}).is_success
        body = client.get("/v1/whatif").json()
        refused = client.post("/v1/whatif/counterfactuals")
    assert refused.status_code == 409
    fleet = body["fleet"]
    assert fleet["mixed_block_sizes"] == [4, 8] and fleet["points"] == []
    for row in body["replicas"]:
        assert row["requests"] == 30 and not row["too_few_sampled"]
        assert all(p["token_hit_rate"] is not None for p in row["points"])
