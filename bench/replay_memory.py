"""Peak memory of a replay and of its report, on a Mooncake-like trace of any length.

    python bench/replay_memory.py [--lines 1000000] [--block-size 512] [--blocks 1000]
                                  [--trace PATH] [--keep DIR] [--no-upper-bound]

Builds the trace first (unless it exists): the public Mooncake trace repeated, each repetition
shifted in time and with fresh hash ids for the blocks that only one line of the original uses,
so shared prefixes stay shared across repetitions and every repetition brings new unique blocks.
Then runs ``prefixcache replay`` and ``prefixcache report`` as child processes and prints each
one's wall time and peak resident memory (the kernel's maximum RSS of that child).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def build_trace(source: Path, out: Path, lines: int) -> None:
    """Write ``lines`` Mooncake lines made from ``source`` (see the module docstring)."""
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    uses = Counter(h for r in records for h in r["hash_ids"])
    span = max(uses) + 1
    period = max(r["timestamp"] for r in records) + 1
    tmp = out.with_suffix(".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(lines):
            rep, j = divmod(i, len(records))
            r = records[j]
            ids = [h if uses[h] > 1 else h + rep * span for h in r["hash_ids"]]
            line = {
                "timestamp": r["timestamp"] + rep * period,
                "input_length": r["input_length"],
                "output_length": r["output_length"],
                "hash_ids": ids,
            }
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    tmp.replace(out)


def measure(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} failed")
    return elapsed, usage.ru_maxrss / 1024  # Linux: kilobytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--blocks", default="1000")
    ap.add_argument("--trace", type=Path, help="where the built trace is kept (default: temp)")
    ap.add_argument("--keep", type=Path, help="run directory to keep (default: temp)")
    ap.add_argument("--no-upper-bound", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or Path(tmp) / f"mooncake_{args.lines}.jsonl"
        if not trace.exists():
            start = time.perf_counter()
            build_trace(TRACE, trace, args.lines)
            print(f"built {trace} ({args.lines:,} lines) in {time.perf_counter() - start:.1f} s")
        run_dir = args.keep or Path(tmp) / "run"
        cmd = [sys.executable, "-m", "prefixcache", "replay", str(trace), "--blocks", args.blocks]
        cmd += ["--block-size", str(args.block_size), "--out", str(run_dir), "--no-progress"]
        if args.no_upper_bound:
            cmd.append("--no-upper-bound")
        if args.keep:
            cmd.append("--force")  # the kept run directory is replaced on every measurement
        wall, rss = measure(cmd)
        print(f"replay: {wall:.1f} s, peak RSS {rss:,.0f} MB ({' '.join(cmd[3:])})")
        wall, rss = measure([sys.executable, "-m", "prefixcache", "report", str(run_dir)])
        print(f"report: {wall:.2f} s, peak RSS {rss:,.0f} MB")


if __name__ == "__main__":
    main()
