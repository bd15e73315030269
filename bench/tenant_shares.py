"""Admit + release with tenant shares, next to the same loop without them, in one process.

    python bench/tenant_shares.py [--tenants 100] [--requests 20000] [--blocks 8192] [--repeats 5]

The workload: ``--tenants`` tenants (cache salts), each with its own four system prompts of 8
to 40 blocks (Zipf-popular tenants), then a unique question of 1-3 blocks; the pool is small
enough that most admissions evict. Three sides run interleaved, each repeat on a fresh manager:

- ``plain``: no tenant accounting (``shares=None``, the default);
- ``counted``: tenant accounting without any share (``shares={}``), the same eviction order;
- ``shares``: every tenant with a guarantee (together half the pool) and the top ten with caps.

Prints requests/s per side (median of repeats), the cost per admit+release in microseconds and
each side's ratio to ``plain``, with the token hit rates (equal for plain and counted: the same
order) and the guarantee breaks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from prefixcache import CORE_BUILD, CacheManager, Namespace
from prefixcache.manager.tenant_shares import TenantShare

BLOCK = 16


def workload(tenants: int, requests: int, seed: int = 5) -> list[tuple[np.ndarray, Namespace]]:
    rng = np.random.default_rng(seed)
    spaces = [Namespace("bench", salt=f"t{i}") for i in range(tenants)]
    systems = [
        [rng.integers(1, 2**30, BLOCK * int(rng.integers(8, 41)), dtype=np.int32) for _ in range(4)]
        for _ in range(tenants)
    ]
    weights = 1.0 / np.arange(1, tenants + 1)
    weights /= weights.sum()
    picks = rng.choice(tenants, size=requests, p=weights)
    out = []
    for t in picks.tolist():
        system = systems[t][int(rng.integers(0, 4))]
        question = rng.integers(1, 2**30, int(rng.integers(BLOCK, 3 * BLOCK)), dtype=np.int32)
        out.append((np.concatenate([system, question]), spaces[t]))
    return out


def shares_for(tenants: int, blocks: int) -> dict[str, TenantShare]:
    each = blocks // (2 * tenants)
    return {f"t{i}": TenantShare(each, blocks // 8 if i < 10 else None) for i in range(tenants)}


def run(
    prompts: list[tuple[np.ndarray, Namespace]], blocks: int, shares: dict | None
) -> tuple[float, CacheManager]:
    mgr = CacheManager(blocks, BLOCK, shares=shares)
    admit, release = mgr.admit, mgr.release
    t0 = time.perf_counter()
    for i, (tokens, ns) in enumerate(prompts):
        admit(i, tokens, ns)
        release(i)
    return time.perf_counter() - t0, mgr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    prompts = workload(args.tenants, args.requests)
    sides = {
        "plain": None,
        "counted": {},
        "shares": shares_for(args.tenants, args.blocks),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    last: dict[str, CacheManager] = {}
    run(prompts[:2000], args.blocks, None)  # warm-up
    for _ in range(args.repeats):
        for name, shares in sides.items():
            elapsed, mgr = run(prompts, args.blocks, shares)
            times[name].append(elapsed)
            last[name] = mgr
    print(f"core: {CORE_BUILD.reason}")
    print(
        f"{args.requests} requests, {args.tenants} tenants, {args.blocks} blocks of {BLOCK} "
        f"tokens, median of {args.repeats} repeats"
    )
    base = statistics.median(times["plain"])
    for name in sides:
        t = statistics.median(times[name])
        mgr = last[name]
        breaks = sum(r.guarantee_breaks for r in mgr.tenant_stats().values())
        print(
            f"{name:8s} {args.requests / t:10,.0f} req/s  {t / args.requests * 1e6:7.2f} us per "
            f"admit+release  ratio {t / base:5.3f}  hit rate {mgr.stats.token_hit_rate:.4f}  "
            f"evicted {mgr.stats.evicted_blocks:,}  guarantee breaks {breaks:,}"
        )


if __name__ == "__main__":
    main()
