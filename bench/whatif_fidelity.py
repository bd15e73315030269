"""Fidelity of the live what-if curves: the service driven with a real trace, its curve
against the exact replay of the trace it recorded.

    python bench/whatif_fidelity.py [--trace PATH] [--capacity 100000] [--requests N]

The trace (default: the Mooncake synthetic trace next to the checkout, else the shipped
sample) is read as ``prefixcache replay`` reads it (512-token hash ids, tokens synthesized per
id), and every request is routed through the service's own app in this process
(``POST /v1/route``, one replica of ``--capacity`` blocks of 16 tokens) three times over: with
the what-if curves sampling 1% of blocks, with 10%, and with every block, the first run also
recording the routed trace (``record_trace``). Then the recorded trace is replayed
(``prefixcache replay``'s own code, the cache manager itself) at each capacity of the curves'
grid (0.25x to 8x), and the table gives, per capacity: the replay's token hit rate and each
live curve's difference from it, in points.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.runner import replay_path

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


def live_curve(
    prompts: list[list[int]], capacity: int, rate: float, record: Path | None
) -> list[dict]:
    """The fleet curve's points after routing every prompt through the service app."""
    data: dict = {
        "whatif": {"rate": rate, "max_memory_mib": 256},
        "replicas": [{"name": "a", "model": "m", "block_size": 16, "capacity_blocks": capacity}],
        "limits": {"max_body_bytes": 1 << 26, "max_prompt_tokens": 1 << 20},
    }
    if record is not None:
        data["record_trace"] = {"path": str(record)}
    config = parse_config(data)
    app = build_service(config, ingest=None)
    with TestClient(app) as client:
        for tokens in prompts:
            r = client.post("/v1/route", json={"model": "m", "tokens": tokens})
            assert r.status_code == 200, r.text
        points: list[dict] = client.get("/v1/whatif").json()["fleet"]["points"]
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=FULL if FULL.exists() else SAMPLE)
    ap.add_argument("--capacity", type=int, default=100_000, help="the replica's blocks")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    args = ap.parse_args()
    source = open_source(args.trace, ReplayConfig(trace_block_size=512, block_size=16))
    if args.requests:
        source = source.head(args.requests)
    prompts = [req.tokens.tolist() for req in source]
    print(f"{args.trace.name}: {len(prompts):,} requests, capacity {args.capacity:,} blocks of 16")
    with tempfile.TemporaryDirectory() as tmp:
        recorded = Path(tmp) / "routed.jsonl"
        curves = {}
        for rate in (0.01, 0.1, 1.0):
            start = time.perf_counter()
            curves[rate] = live_curve(
                prompts, args.capacity, rate, recorded if rate == 0.01 else None
            )
            print(f"  routed at {rate:.0%} sampling in {time.perf_counter() - start:.0f} s")
        lines = recorded.read_text().splitlines()
        assert len(lines) == len(prompts) and "hash_ids" in json.loads(lines[0])
        print(
            f"{'factor':>7} {'blocks':>9} {'replay':>8} {'live 1%':>9} {'live 10%':>9} {'all':>9}"
        )
        worst = {rate: 0.0 for rate in curves}
        inside = {rate: 0 for rate in curves}
        for i, point in enumerate(curves[1.0]):
            config = ReplayConfig(
                capacity_blocks=point["blocks"], block_size=16, trace_block_size=16
            )
            exact = replay_path(recorded, config).to_report_dict()["token_hit_rate"]
            cells = []
            for rate in curves:
                live = curves[rate][i]
                if live["token_hit_rate"] is None:  # too few sampled blocks to answer
                    cells.append(f"{'-':>9}")
                    continue
                d = live["token_hit_rate"] - exact
                worst[rate] = max(worst[rate], 100 * abs(d))
                inside[rate] += abs(d) <= 2 * live["stderr"]
                cells.append(f"{100 * d:+7.2f}pp")
            print(
                f"{point['factor']:>8}x {point['blocks']:>9,} {100 * exact:8.2f}% "
                + " ".join(cells)
            )
        print(
            "worst |live - replay|: " + ", ".join(f"{r:.0%} {w:.2f} pp" for r, w in worst.items())
        )
        errors = {
            rate: max((p["stderr"] for p in points if p["stderr"] is not None), default=0.0)
            for rate, points in curves.items()
        }
        print(
            "largest stderr the service gave: "
            + ", ".join(f"{r:.0%} {100 * e:.2f} pp" for r, e in errors.items())
        )
        print(
            "replay within 2 stderr of the live curve: "
            + ", ".join(f"{r:.0%} {inside[r]} of {len(curves[r])}" for r in curves if r < 1)
            + " (over many samples: bench/whatif_coverage.py)"
        )


if __name__ == "__main__":
    main()
