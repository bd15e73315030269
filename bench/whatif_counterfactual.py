"""Counterfactual fleets from the recorded trace: what ``POST /v1/whatif/counterfactuals``
answers for N-1, N+1, 2N replicas and each other policy, how long the replays take, and what
the same fleets served on the original trace.

    python bench/whatif_counterfactual.py [--trace PATH] [--replicas 4] [--capacity 20000]
                                          [--requests N] [--served]

Every request of the trace (default: the Mooncake synthetic trace next to the checkout, else
the shipped sample), read as ``prefixcache replay`` reads it (512-token hash ids, 16-token
blocks), is routed through the service's own app in this process (``POST /v1/route``,
``--replicas`` replicas of ``--capacity`` blocks, policy ``prefix``) with ``record_trace`` on.
Then ``POST /v1/whatif/counterfactuals`` starts the replays of the recorded window and
``GET /v1/whatif/counterfactuals`` is polled until they are done: each scenario's hit rate and
seconds, the job's wall time and the CPU its replay processes used (this process's children).
``--served`` also replays each scenario on the original trace at its own arrivals with its
outputs (what such a fleet would have served under load). ``--trace`` also takes a scenario
file (``--requests`` then bounds it).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.runner import replay_path, replay_source

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
POLICY = "prefix"


def counterfactuals(
    prompts: list[list[int]], replicas: int, capacity: int, record: Path
) -> tuple[dict[str, Any], float, float, float]:
    """Route every prompt through the service app recording the trace at ``record``, then
    the counterfactual job's answer, the routing seconds, the job's wall seconds and the CPU
    seconds of its replay processes."""
    data: dict[str, Any] = {
        "routing": {"policy": POLICY},
        "replicas": [
            {"name": f"r{i}", "model": "m", "block_size": 16, "capacity_blocks": capacity}
            for i in range(replicas)
        ],
        "limits": {"max_body_bytes": 1 << 26, "max_prompt_tokens": 1 << 20},
        "record_trace": {"path": str(record)},
    }
    config = parse_config(data)
    app = build_service(config, ingest=None)
    with TestClient(app) as client:
        start = time.perf_counter()
        for i, tokens in enumerate(prompts):
            rid = f"q{i}"
            r = client.post("/v1/route", json={"model": "m", "tokens": tokens, "request_id": rid})
            assert r.status_code == 200, r.text
            client.post("/v1/release", json={"request_id": rid})
        routing = time.perf_counter() - start
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        r = client.post("/v1/whatif/counterfactuals")
        assert r.status_code == 202, r.text
        while True:
            answer: dict[str, Any] = client.get("/v1/whatif/counterfactuals").json()
            if answer["state"] != "running":
                break
            time.sleep(0.5)
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    assert answer["state"] == "done", answer
    return answer, routing, wall, used


def served(trace: Path, n: int, policy: str, capacity: int, head: int | None) -> float:
    """The fleet replay's token hit rate on the original trace (its arrivals and outputs)."""
    config = ReplayConfig(
        mode="serving",
        replicas=n,
        routing=policy,
        capacity_blocks=capacity,
        block_size=16,
        trace_block_size=512,
        model="llama-3.1-8b",
    )
    if trace.suffix in (".yaml", ".yml", ".toml"):  # a scenario sets its own lengths
        config = dataclasses.replace(config, trace_block_size=ReplayConfig().trace_block_size)
    if head is None:
        return float(replay_path(trace, config).to_report_dict()["token_hit_rate"])
    source = open_source(trace, config).head(head)
    return float(replay_source(source, config).to_report_dict()["token_hit_rate"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=FULL if FULL.exists() else SAMPLE)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=20_000, help="each replica's blocks")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--served", action="store_true", help="also replay the original trace")
    args = ap.parse_args()
    source = open_source(args.trace, ReplayConfig(trace_block_size=512, block_size=16))
    if args.requests:
        source = source.head(args.requests)
    prompts = [req.tokens.tolist() for req in source]
    print(
        f"{args.trace.name}: {len(prompts):,} requests, {args.replicas} replicas of "
        f"{args.capacity:,} blocks of 16, policy {POLICY}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "routed.jsonl"
        answer, routing, wall, cpu = counterfactuals(prompts, args.replicas, args.capacity, record)
        size = record.stat().st_size / (1 << 20)
    print(
        f"  routed in {routing:.1f} s; recorded {answer['window_requests']:,} requests "
        f"({size:.1f} MiB); the replays: {wall:.1f} s wall, {cpu:.1f} s CPU "
        f"({1e3 * cpu / max(1, len(prompts)):.1f} ms of CPU per recorded request)"
    )
    print(f"  {answer['command']}")
    head = f"{'scenario':<26} {'replayed':>9} {'seconds':>8}"
    print(head + (f" {'served':>8}" if args.served else ""))
    for row in answer["scenarios"]:
        line = f"{row['scenario']:<26} {100 * row['token_hit_rate']:8.2f}% {row['seconds']:8.1f}"
        if args.served:
            rate = served(args.trace, row["replicas"], row["policy"], args.capacity, args.requests)
            line += f" {100 * rate:7.2f}%"
        print(line)


if __name__ == "__main__":
    main()
