"""Memory of the live what-if curves after many routed requests: bounded by the setting.

    python bench/whatif_memory.py [--requests 10000000] [--replicas 16] [--blocks 4]
                                  [--rate 0.01] [--max-memory-mib 64]

Feeds ``LiveCurves`` (the service's what-if sampler, the same object ``prefixcache serve``
feeds from its router) ``--requests`` prompts of ``--blocks`` full blocks each, round robin over
``--replicas`` replicas: a quarter of them start with one of 10,000 shared first blocks, every
other block is new, so the distinct blocks grow without end, as on a long-running service. At
checkpoints it prints the Python memory the curves hold (tracemalloc), the sampled blocks per
curve, the sampling rate they have fallen to, and the time per request.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.live_curves import LiveCurves, WhatIfConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--max-memory-mib", type=float, default=64.0)
    args = ap.parse_args()
    specs = [ReplicaSpec(f"r{i}", Namespace("m"), 16, 32_768) for i in range(args.replicas)]
    curves = LiveCurves(WhatIfConfig(True, args.rate, args.max_memory_mib), lambda: specs)
    names = [s.name for s in specs]
    rng = np.random.default_rng(0)
    shared = [rng.bytes(16) for _ in range(10_000)]
    chunk = 100_000
    checkpoints = {args.requests // 10, args.requests // 2, args.requests}
    tracemalloc.start()
    start = time.perf_counter()
    done = 0
    print(f"{args.replicas} replicas, {args.blocks} blocks a request, rate {args.rate}, "
          f"bound {args.max_memory_mib:g} MiB")  # fmt: skip
    while done < args.requests:
        n = min(chunk, args.requests - done)
        raw = rng.bytes(16 * n * args.blocks)
        firsts = rng.integers(0, len(shared), n)
        for i in range(n):
            base = 16 * args.blocks * i
            digests = [raw[base + 16 * k : base + 16 * (k + 1)] for k in range(args.blocks)]
            if i % 4 == 0:
                digests[0] = shared[firsts[i]]
            curves.observe(names[(done + i) % len(names)], digests, 16 * args.blocks, 16)
        done += n
        if done in checkpoints:
            current, _ = tracemalloc.get_traced_memory()
            snap = curves.snapshot()
            rows = [*snap["replicas"], snap["fleet"]]
            elapsed = time.perf_counter() - start
            print(
                f"{done:>11,} requests  {current / 2**20:7.1f} MiB held  "
                f"sampled blocks per curve max {max(r['sampled_blocks'] for r in rows):,}  "
                f"rate now {min(r['rate'] for r in rows):.5f}  "
                f"{elapsed / done * 1e6:.1f} us a request"
            )


if __name__ == "__main__":
    main()
