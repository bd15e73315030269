"""Decode bookkeeping: append one token at a time to a batch of running requests.

    python bench/decode_loop.py [--batch 256] [--steps 512] [--repeats 3]

Each step appends one token to every request (allocating a block every block_size tokens and
indexing it once full), then builds the batch's block-table tensor, as a runtime does per step.
Prints appends/s and the cost of building the tables, median of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from prefixcache import CORE_BUILD, CacheManager, Namespace


def run(batch: int, steps: int, block_size: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 128_000, 1000).astype("<i4")
    per_seq = -(-(1000 + 64 + steps) // block_size)
    mgr = CacheManager(batch * per_seq + 64, block_size)
    ns = Namespace(model="bench")
    ids = list(range(batch))
    for i in ids:
        mgr.admit(i, np.concatenate([system, rng.integers(0, 128_000, 64).astype("<i4")]), ns)
    new = rng.integers(0, 128_000, (steps, batch)).tolist()
    append = mgr.append
    t_append = t_tables = 0.0
    for step in range(steps):
        row = new[step]
        t0 = time.perf_counter()
        for i in ids:
            append(i, row[i])
        t1 = time.perf_counter()
        mgr.block_tables(ids)
        t_tables += time.perf_counter() - t1
        t_append += t1 - t0
    mgr.check_integrity()
    return t_append, t_tables


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = [run(args.batch, args.steps, args.block_size) for _ in range(args.repeats)]
    appends = args.batch * args.steps
    t_app = statistics.median(r[0] for r in runs)
    t_tab = statistics.median(r[1] for r in runs)
    print(f"decode: batch {args.batch} x {args.steps} steps, block_size={args.block_size}")
    print(f"  appends/s            {appends / t_app:12,.0f}  ({t_app / appends * 1e6:.2f} us each)")
    print(f"  block_tables/step    {t_tab / args.steps * 1e3:12.3f}  ms for {args.batch} rows")


if __name__ == "__main__":
    main()
