"""Soak: random steps of admit / append / fork / finish / abort / pin / evict through the K/V
fingerprint runtime of the tests, checking every read of K/V and, periodically, every invariant.

    python bench/soak.py [--ops 1000000] [--seed 0] [--policy lru] [--host-blocks 0]

Prints the operations run, steps, K/V reads checked, and the rate. Exits non-zero on the first
wrong read or broken invariant. With ``--host-blocks N`` evicted blocks go to a host tier of N
slots and come back by loads; the runtime runs every offload and load and checks the host slots'
K/V too, and the blocks moved are printed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prefixcache import CORE_BUILD, CacheManager, Namespace, OutOfBlocksError, RequestTooLargeError
from tests.kv_fingerprint import FingerprintRuntime

NAMESPACES = [
    Namespace(model="m"),
    Namespace(model="m", salt="t2"),
    Namespace(model="m", adapter="a"),
]
BASES = [list(range(0, 40)), list(range(0, 20)) + list(range(500, 520)), [7] * 30]


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--host-blocks", type=int, default=0, help="host tier slots (0: none)")
    ap.add_argument("--check-every", type=int, default=2000, help="ops between integrity checks")
    args = ap.parse_args()
    r = random.Random(args.seed)
    mgr = CacheManager(
        args.blocks, 4, policy=args.policy, stepped=True, host_blocks=args.host_blocks
    )
    rt = FingerprintRuntime(mgr)
    pins: list[int] = []
    next_id = steps = rejected = 0
    t0 = time.perf_counter()
    for op_index in range(args.ops):
        ids = [x for x in rt.live if x not in rt.finished]
        op = r.choices("apfxrevus", weights=[6, 6, 1, 3, 1, 1, 1, 1, 4])[0]
        if op == "a":
            base = BASES[r.randrange(3)]
            tokens = base[: r.randrange(len(base))] + [
                r.randrange(4) for _ in range(r.randrange(12))
            ]
            if tokens:
                try:
                    rt.admit(next_id, tokens, NAMESPACES[r.randrange(3)], priority=r.randrange(3))
                except (OutOfBlocksError, RequestTooLargeError):
                    rejected += 1
                next_id += 1
        elif op in "pfxr" and ids:
            rid = r.choice(ids)
            if op == "p":
                try:
                    rt.append(rid, [r.randrange(4) for _ in range(r.randint(1, 6))])
                except OutOfBlocksError:
                    rejected += 1
            elif op == "f":
                rt.fork(rid, next_id)
                next_id += 1
            elif op == "x":
                rt.finish(rid)
            else:
                rt.abort(rid)
        elif op == "e":
            mgr.evict(r.randrange(8))
        elif op == "v":
            handle, _ = mgr.pin(
                BASES[r.randrange(3)][: r.randrange(40)] + [0], NAMESPACES[r.randrange(3)]
            )
            if handle:
                pins.append(handle)
        elif op == "u" and pins:
            mgr.unpin(pins.pop(0))
        elif op == "s":
            rt.step()
            steps += 1
            if len(rt.live) > 24:  # keep the batch bounded: the oldest finish
                for rid in sorted(rt.live, key=str)[:8]:
                    if rid in rt.live and rid not in rt.finished:
                        rt.finish(rid)
        if op_index % args.check_every == 0:
            mgr.check_integrity()
    rt.step()
    mgr.check_integrity()
    dt = time.perf_counter() - t0
    print(
        f"{args.ops:,} ops ({args.policy}, {args.blocks} blocks): {steps:,} steps, "
        f"{rt.reads:,} K/V reads checked, 0 wrong; {rejected:,} calls refused for capacity; "
        f"{mgr.stats.aborted_requests:,} requests dropped by abort; {dt:.0f} s "
        f"({args.ops / dt:,.0f} ops/s)"
    )
    if args.host_blocks:
        st = mgr.stats
        print(
            f"host tier of {args.host_blocks} slots: {st.offloaded_blocks:,} blocks offloaded, "
            f"{st.loaded_blocks:,} loaded, {st.host_evicted_blocks:,} evicted or dropped"
        )


if __name__ == "__main__":
    main()
