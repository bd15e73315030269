"""Coverage of the live what-if curves' standard error: over sample seeds, how often the exact
LRU hit rate lies within 2 standard errors of the curve the service would give.

    python bench/whatif_coverage.py [--trace PATH] [--seeds 20] [--first-seed 0] [--rates 0.01,0.1]
                                    [--capacity 100000] [--max-memory-mib 256] [--requests N]

The trace (default: the Mooncake synthetic trace next to the checkout, else the shipped sample)
is read as 16-token blocks, 32 to each 512-token hash id. Each seed hashes the same prompts
under another namespace (as another model name or salt would), so a block is sampled or not
independently of the other seeds: a fresh sample of the same traffic. Each seed's prompts go
through the service's own curves (``LiveCurves.observe``, one replica of ``--capacity``
blocks, a memory bound that keeps the rate asked), and its fleet curve is read at the six
capacities the service reports (0.25x to 8x). The truth is the exact LRU of the same prompts (every
reference's reuse distance, measured as the prompt finds the cache, its blocks then referenced
deepest first: what the curves estimate), from one pass.

Printed per rate: for each capacity the exact hit rate, the root mean square of the curve's
error, its mean (bias) and the median standard error, in points; then the share of the
seeds x capacities whose error is within 2 standard errors (target: 90% or more, at 1% and at
10%), and the largest error in standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import xxhash

from prefixcache import Namespace
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.live_curves import LiveCurves, WhatIfConfig

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
B = 16
SUB = 512 // B


def read_trace(path: Path, limit: int | None) -> tuple[list[list[int]], list[int]]:
    """Each request's 16-token block ids (root first) and its prompt length in tokens."""
    prompts, lengths = [], []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            blocks = row["input_length"] // B
            ids = [h * SUB + k for h in row["hash_ids"] for k in range(SUB)][:blocks]
            prompts.append(ids)
            lengths.append(row["input_length"])
            if limit is not None and len(prompts) >= limit:
                break
    return prompts, lengths


def exact_curve(prompts: list[list[int]], lengths: list[int], sizes: list[int]) -> list[float]:
    """The exact LRU's token hit rate at each size, from every reference's reuse distance."""
    n = sum(len(p) for p in prompts) + 1
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    hits = [0] * len(sizes)
    clock = 0
    for ids in prompts:
        for block in ids:
            t = last.get(block)
            if t is not None:
                i, under = t + 1, 0
                while i > 0:
                    under += tree[i]
                    i -= i & -i
                since = len(last) - under
                for k, size in enumerate(sizes):
                    hits[k] += since < size
        for block in reversed(ids):
            t = last.get(block)
            if t is not None:
                i = t + 1
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
            i = clock + 1
            while i <= n:
                tree[i] += 1
                i += i & -i
            last[block] = clock
            clock += 1
    return [h * B / sum(lengths) for h in hits]


def seed_curve(
    prompts: list[list[int]], lengths: list[int], rate: float, seed: int, args: argparse.Namespace
) -> list[dict]:
    """The fleet curve's points for the sample ``seed`` hashes the prompts into."""
    spec = ReplicaSpec("a", Namespace("m"), B, args.capacity)
    curves = LiveCurves(WhatIfConfig(rate=rate, max_memory_mib=args.max_memory_mib), lambda: [spec])
    salt = b"%d:" % seed
    for ids, n in zip(prompts, lengths, strict=True):
        curves.observe("a", [xxhash.xxh3_128_digest(salt + b"%d" % i) for i in ids], n, B)
    points: list[dict] = curves.snapshot()["fleet"]["points"]
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=FULL if FULL.exists() else SAMPLE)
    ap.add_argument("--seeds", type=int, default=20, help="samples of the same traffic")
    ap.add_argument("--first-seed", type=int, default=0, help="the first sample's seed")
    ap.add_argument("--rates", default="0.01,0.1", help="sampling rates, comma-separated")
    ap.add_argument("--capacity", type=int, default=100_000, help="the replica's blocks")
    ap.add_argument("--max-memory-mib", type=float, default=256.0, help="whatif.max_memory_mib")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    args = ap.parse_args()
    prompts, lengths = read_trace(args.trace, args.requests)
    refs = sum(len(p) for p in prompts)
    print(f"{args.trace.name}: {len(prompts):,} requests, {refs:,} block references of {B}")
    start = time.perf_counter()
    sizes = [int(f * args.capacity) for f in (0.25, 0.5, 1, 2, 4, 8)]
    exact = exact_curve(prompts, lengths, sizes)
    print(f"exact LRU at {len(sizes)} capacities in {time.perf_counter() - start:.0f} s")
    for rate in [float(r) for r in args.rates.split(",")]:
        start = time.perf_counter()
        errors: list[list[tuple[float, float]]] = [[] for _ in sizes]
        unanswered = 0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for k, point in enumerate(seed_curve(prompts, lengths, rate, seed, args)):
                if point["token_hit_rate"] is None:
                    unanswered += 1
                    continue
                errors[k].append((point["token_hit_rate"] - exact[k], point["stderr"]))
        took = time.perf_counter() - start
        print(f"\nrate {rate:g}, {args.seeds} seeds ({took:.0f} s)")
        print(f"{'blocks':>9} {'exact':>7} {'rms err':>8} {'mean':>7} {'median stderr':>14}")
        for k, size in enumerate(sizes):
            if not errors[k]:
                print(f"{size:>9,} {100 * exact[k]:6.2f}%   (no figure: too few sampled)")
                continue
            rms = math.sqrt(sum(e * e for e, _ in errors[k]) / len(errors[k]))
            mean = statistics.fmean(e for e, _ in errors[k])
            typical = statistics.median(s for _, s in errors[k])
            print(
                f"{size:>9,} {100 * exact[k]:6.2f}% {100 * rms:7.2f}pp {100 * mean:+6.2f}pp "
                f"{100 * typical:12.2f}pp"
            )
        flat = [p for row in errors for p in row]
        if not flat:
            print(f"no figures: every curve too small to answer ({unanswered} points)")
            continue
        inside = sum(abs(e) <= 2 * s for e, s in flat)
        worst = max(abs(e) / s if s > 0 else (math.inf if e else 0.0) for e, s in flat)
        print(
            f"within 2 stderr: {inside} of {len(flat)} ({inside / len(flat):.1%}); "
            f"largest error {worst:.1f} stderr"
            + (f"; {unanswered} points without a figure (too few sampled)" if unanswered else "")
        )


if __name__ == "__main__":
    main()
