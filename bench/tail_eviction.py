"""Eviction from the tail of one very long node against eviction of as many small nodes.

    python bench/tail_eviction.py [--blocks 100000] [--admissions 2000]

Fills a pool of 16-token blocks either with one prompt of ``--blocks`` blocks (one node) or with
``--blocks`` one-block prompts (as many nodes), then admits fresh 4-block prompts, each of which
evicts 4 blocks. Prints the median cost per admission of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from prefixcache import CacheManager

P = 16


def filled(blocks: int, long_node: bool) -> CacheManager:
    mgr = CacheManager(blocks, P)
    if long_node:
        mgr.admit("fill", np.arange(blocks * P, dtype=np.int32) % 50_000)
        mgr.release("fill")
    else:
        base = np.arange(P, dtype=np.int32)
        for i in range(blocks):
            mgr.admit(i, base + 60_000 + i * P)
            mgr.release(i)
    assert mgr.block_counts().cached == blocks
    return mgr


def admission_cost(mgr: CacheManager, admissions: int) -> float:
    """Median seconds per admission of a fresh 4-block prompt (each evicts 4 blocks)."""
    rng = np.random.default_rng(1)
    times = []
    for i in range(admissions):
        prompt = rng.integers(0, 2**31 - 1, 4 * P, dtype=np.int64).astype(np.int32)
        t0 = time.perf_counter()
        mgr.admit(("q", i), prompt)
        times.append(time.perf_counter() - t0)
        mgr.release(("q", i))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000, help="cached blocks before admitting")
    ap.add_argument("--admissions", type=int, default=2000, help="evicting admissions to time")
    args = ap.parse_args()
    long_mgr, small_mgr = filled(args.blocks, True), filled(args.blocks, False)
    long_cost = admission_cost(long_mgr, args.admissions)
    small_cost = admission_cost(small_mgr, args.admissions)
    print(f"pool {args.blocks:,} blocks of {P} tokens, {args.admissions:,} admissions of 4 blocks")
    print(f"  one {args.blocks:,}-block node   {long_cost * 1e6:8.1f} us/admission (median)")
    print(f"  {args.blocks:,} one-block nodes {small_cost * 1e6:8.1f} us/admission (median)")
    print(f"  ratio long/small          {long_cost / small_cost:8.2f}")
    long_mgr.check_integrity()


if __name__ == "__main__":
    main()
