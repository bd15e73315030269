"""Fidelity of the live counterfactuals: the shadow fleets' answers against a fleet replay of
the same requests with that replica count and routing policy.

    python bench/whatif_counterfactual.py [--trace PATH] [--replicas 4] [--capacity 20000]
                                          [--rates 0.01,0.1,0.25,1] [--time-scale 1000]

Every request of the trace (default: the Mooncake synthetic trace next to the checkout, else
the shipped sample), read as ``prefixcache replay`` reads it (512-token hash ids, 16-token
blocks), is routed through the service's own app in this process (``POST /v1/route``,
``--replicas`` replicas of ``--capacity`` blocks, policy ``prefix``) with
``whatif.counterfactual_rate`` at each rate, and ``/v1/whatif``'s counterfactuals are read
(each answer with its standard error).
The first pass also records the routed trace (``record_trace``: what the service saw, the
prompts' block hashes and no outputs). Then each scenario (N-1, N+1, 2N replicas, each other
policy) is replayed with ``prefixcache replay``'s fleet mode twice: the original trace at its
own arrival times with its outputs ("served": what such a fleet would have served), and the
recorded trace with one output token a request, its arrivals stretched ``--time-scale`` times
("recorded": the exact answer for what the shadows see, prompts without load). The table gives
both hit rates and each shadow's difference from the second, with the shadow's standard
error. ``--trace`` also takes a scenario file (``--requests`` then bounds it).
``--whole-blocks`` routes each prompt cut to its full blocks, so the recorded replay's one
output token never completes a block (a shadow stores prompt blocks only).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.app import create_app
from prefixcache.fleet.service.configuration.config_file import build_router, parse_config
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.runner import replay_path, replay_source

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
POLICY = "prefix"


def shadows(
    prompts: list[list[int]], replicas: int, capacity: int, rate: float, record: Path | None
) -> dict:
    """``/v1/whatif``'s counterfactuals after routing every prompt through the service app
    (``record``: the routed trace written there too)."""
    data: dict = {
        "whatif": {"rate": 0.01, "counterfactual_rate": rate},
        "routing": {"policy": POLICY},
        "replicas": [
            {"name": f"r{i}", "model": "m", "block_size": 16, "capacity_blocks": capacity}
            for i in range(replicas)
        ],
        "limits": {"max_body_bytes": 1 << 26, "max_prompt_tokens": 1 << 20},
    }
    if record is not None:
        data["record_trace"] = {"path": str(record)}
    config = parse_config(data)
    app = create_app(build_router(config, MemoryFleetIndex()), config)
    with TestClient(app) as client:
        for i, tokens in enumerate(prompts):
            rid = f"q{i}"
            r = client.post("/v1/route", json={"model": "m", "tokens": tokens, "request_id": rid})
            assert r.status_code == 200, r.text
            client.post("/v1/release", json={"request_id": rid})
        # the shadows run in their own process: wait for it to work through what was routed
        deadline = time.monotonic() + 1800
        while True:
            answer: dict = client.get("/v1/whatif").json()["counterfactuals"]
            if "error" not in answer or time.monotonic() > deadline:
                break
    assert "error" not in answer, answer["error"]
    return answer


def replayed(
    trace: Path,
    n: int,
    policy: str,
    capacity: int,
    scale: float,
    head: int | None,
    *,
    recorded: bool = False,
) -> float:
    """The fleet replay's token hit rate for ``n`` replicas under ``policy`` (``recorded``:
    the trace the service wrote, 16-token ids, prompts only: one output token each)."""
    config = ReplayConfig(
        mode="serving",
        replicas=n,
        routing=policy,
        capacity_blocks=capacity,
        block_size=16,
        trace_block_size=16 if recorded else 512,
        time_scale=scale,
        model="llama-3.1-8b",
        output_len=1,
    )
    if recorded:
        return float(replay_path(trace, config).to_report_dict()["token_hit_rate"])
    if trace.suffix in (".yaml", ".yml", ".toml"):  # a scenario sets its own lengths
        d = ReplayConfig()
        config = dataclasses.replace(
            config, trace_block_size=d.trace_block_size, output_len=d.output_len
        )
    if head is None:
        return replay_path(trace, config).to_report_dict()["token_hit_rate"]
    source = open_source(trace, config).head(head)
    return replay_source(source, config).to_report_dict()["token_hit_rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=FULL if FULL.exists() else SAMPLE)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=20_000, help="each replica's blocks")
    ap.add_argument("--rates", default="0.01,0.1,0.25,1", help="counterfactual rates to try")
    ap.add_argument("--time-scale", type=float, default=1000.0, help="the recorded trace's stretch")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument(
        "--whole-blocks", action="store_true", help="route every prompt cut to its full blocks"
    )
    args = ap.parse_args()
    source = open_source(args.trace, ReplayConfig(trace_block_size=512, block_size=16))
    if args.requests:
        source = source.head(args.requests)
    prompts = [req.tokens.tolist() for req in source]
    if args.whole_blocks:  # no partial last block for the replay's one output token to complete
        prompts = [p[: len(p) // 16 * 16] for p in prompts if len(p) >= 16]
    print(
        f"{args.trace.name}: {len(prompts):,} requests, {args.replicas} replicas of "
        f"{args.capacity:,} blocks of 16, policy {POLICY}"
    )
    rates = [float(x) for x in args.rates.split(",")]
    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        recorded = Path(tmp) / "routed.jsonl"
        for rate in rates:
            start = time.perf_counter()
            record = recorded if rate == rates[0] else None
            answers[rate] = shadows(prompts, args.replicas, args.capacity, rate, record)
            a = answers[rate]
            print(
                f"  shadows at {rate:.0%}: {a['sampled_blocks']:,} sampled blocks of "
                f"{a['sampled_requests']:,} requests, "
                f"miniature replicas of {a['shadow_capacity_blocks']:,} blocks"
                f"{' (too small)' if a['too_small'] else ''}, {time.perf_counter() - start:.0f} s"
            )
        rows = {s["scenario"]: s for s in answers[rates[0]]["scenarios"]}
        head = ("scenario", "served", "recorded") + tuple(f"shadow {r:.0%}" for r in rates)
        print(f"{head[0]:<26} {head[1]:>8} {head[2]:>9} " + " ".join(f"{h:>17}" for h in head[3:]))
        worst = dict.fromkeys(rates, 0.0)
        for name, row in rows.items():
            n, policy = row["replicas"], row["policy"]
            served = replayed(args.trace, n, policy, args.capacity, 1.0, args.requests)
            exact = replayed(
                recorded, n, policy, args.capacity, args.time_scale, None, recorded=True
            )
            cells = []
            for rate in rates:
                est = next(s for s in answers[rate]["scenarios"] if s["scenario"] == name)
                diff = 100 * (est["token_hit_rate"] - exact)
                worst[rate] = max(worst[rate], abs(diff))
                cells.append(f"{diff:+7.2f} ±{100 * est['stderr']:5.2f} pp")
            print(f"{name:<26} {100 * served:7.2f}% {100 * exact:8.2f}% " + " ".join(cells))
    print(
        "worst |shadow - replay of the recorded trace|: "
        + ", ".join(f"{r:.0%} {w:.2f} pp" for r, w in worst.items())
    )


if __name__ == "__main__":
    main()
