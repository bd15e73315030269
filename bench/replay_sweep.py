"""A planner's sweep: ten fleet configurations over a Mooncake trace, as ``prefixcache replay``.

    python bench/replay_sweep.py [--trace PATH] [--jobs 2] [--baseline TREE] [--keep DIR]

Runs ``prefixcache replay TRACE --mode serving --blocks 400 --replicas 2,4,8,16,32 --routing
prefix_cost,round_robin`` (10 points, llama-3.1-8b on an H100, 512-token blocks) in a child
process and prints its wall time, its peak resident memory and the sweep's rows. The trace is
Mooncake's conversation trace (``FAST25-release/traces/conversation_trace.jsonl`` in
kvcache-ai/Mooncake, 12,031 requests) when given, else the synthetic one. ``--baseline TREE``
runs the same sweep with the ``prefixcache`` package found in ``TREE`` (an older checkout,
built) first, and says whether every figure of every row came out the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SWEEP = ("--mode", "serving", "--model", "llama-3.1-8b", "--blocks", "400")
POINTS = ("--replicas", "2,4,8,16,32", "--routing", "prefix_cost,round_robin")
SHOWN = ("replicas", "routing", "token_hit_rate", "pooled_token_hit_rate", "ttft_p50_s")


def sweep(trace: Path, jobs: int, out: Path, tree: Path | None) -> tuple[float, float, Any]:
    """Wall seconds, peak RSS (MB, of the largest process among the command and its workers)
    and report.json of one sweep."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "prefixcache", "replay", str(trace), *SWEEP, *POINTS]
    cmd += ["--jobs", str(jobs), "--out", str(out), "--no-progress"]
    start = time.perf_counter()
    cwd = tree if tree is not None else ROOT  # ``-m`` puts the working directory on the path
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    report = json.loads((out / "report.json").read_text())
    return wall, usage.ru_maxrss / 1024, report  # Linux: KB, over the child and its workers


def rows(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(point.get(key) for key in SHOWN) for point in report["sweep"]]


def figures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every sweep row, without what measures the run itself (wall seconds, requests/s)."""
    return [
        {k: v for k, v in point.items() if "seconds" not in k and "per_second" not in k}
        for point in report["sweep"]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--baseline", type=Path, help="a checkout whose prefixcache to time first")
    ap.add_argument("--keep", type=Path, help="where the run directories go (default: temp)")
    args = ap.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"no trace at {args.trace}")
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        print(f"{args.trace.name}: {' '.join(SWEEP + POINTS)} --jobs {args.jobs}")
        before = None
        if args.baseline is not None:
            wall, rss, before = sweep(args.trace, args.jobs, where / "baseline", args.baseline)
            print(f"baseline ({args.baseline}): {wall:7.1f} s wall, peak RSS {rss:,.0f} MB")
        wall, rss, report = sweep(args.trace, args.jobs, where / "this", None)
        print(f"this tree:  {wall:7.1f} s wall, peak RSS {rss:,.0f} MB")
        if before is not None:
            print(
                "every figure of every row equal to the baseline's:",
                figures(before) == figures(report),
            )
        print(" | ".join(SHOWN))
        for row in rows(report):
            print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))


if __name__ == "__main__":
    main()
