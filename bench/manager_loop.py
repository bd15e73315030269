"""Manager loop on a shared-prompt workload: admit (hashing included), then release.

    python bench/manager_loop.py [--requests 2000] [--blocks 20000] [--repeats 5]
    python bench/manager_loop.py --scale [--requests 20000] [--blocks 200000]

Prints requests/s (median of repeats, each on a fresh manager) for int32 arrays and for Python
lists (what most schedulers hold) next to a conventional per-block baseline run interleaved in
the same process, the cost of turning a list into token ids next to the plain numpy conversion,
the token hit rate next to the infinite-cache bound, and memory per cached block (RSS delta and
tracemalloc).

``--scale`` runs the workload once at scale instead (20,000 requests, about 159M prompt tokens,
a 200,000-block pool by default) and prints the cost per request while the pool fills (before the
first eviction) and once it is full, their ratio, the same per 1,000 prompt tokens (prompts grow
as chats go on), and the requests after the pool filled run again on a pool that never fills, so
that the cost of eviction shows apart from that of the longer prompts late in the workload.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_block_manager import BaselineBlockManager
from workload import infinite_cache_hit_rate, shared_prompt_workload

from prefixcache import CORE_BUILD, CacheManager, Namespace
from prefixcache.blocks.tokens import as_token_array


def rss_bytes() -> int:
    """Resident set size, after returning freed heap memory to the OS (so reuse hides nothing)."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def run(prompts: list, blocks: int, block_size: int) -> tuple[float, CacheManager]:
    mgr = CacheManager(blocks, block_size)
    ns = Namespace(model="bench")
    admit, release = mgr.admit, mgr.release
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        admit(i, p, ns)
        release(i)
    return time.perf_counter() - t0, mgr


def run_baseline(
    prompts: list[np.ndarray], blocks: int, block_size: int
) -> tuple[float, BaselineBlockManager]:
    mgr = BaselineBlockManager(blocks, block_size)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        mgr.admit(i, p)
        mgr.release(i)
    return time.perf_counter() - t0, mgr


def measure_memory(prompts: list[np.ndarray], blocks: int, block_size: int) -> None:
    base_rss = rss_bytes()
    _, mgr = run(prompts, blocks, block_size)
    rss = rss_bytes() - base_rss
    cached = mgr.block_counts().cached
    del mgr
    gc.collect()
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    _, mgr = run(prompts, blocks, block_size)
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    traced = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    print(f"  cached blocks     {cached:10,}  in {mgr.index.num_nodes:,} nodes")
    print(f"  bytes/cached blk  {traced / cached:10.1f}  (tracemalloc, incl. 64 B of token ids)")
    print(f"  bytes/cached blk  {rss / cached:10.1f}  (RSS delta, incl. allocator overhead)")


def scale_phases(
    prompts: list[np.ndarray], blocks: int, block_size: int
) -> tuple[list[float], int | None, CacheManager]:
    """Seconds per request, and the request at which the pool first evicted (None: never)."""
    mgr = CacheManager(blocks, block_size)
    ns = Namespace(model="bench")
    admit, release, stats, clock = mgr.admit, mgr.release, mgr.stats, time.perf_counter
    times = []
    full_at = None
    for i, p in enumerate(prompts):
        t0 = clock()
        admit(i, p, ns)
        release(i)
        times.append(clock() - t0)
        if full_at is None and stats.evicted_blocks:
            full_at = i
    return times, full_at, mgr


def scale(args: argparse.Namespace) -> None:
    requests = args.requests or 20_000
    blocks = args.blocks or 200_000
    prompts = shared_prompt_workload(requests)
    tokens = sum(len(p) for p in prompts)
    print(
        f"scale: {requests} requests, {tokens / 1e6:.1f}M prompt tokens, "
        f"block_size={args.block_size}, pool={blocks} blocks"
    )
    gc.collect()
    times, full_at, mgr = scale_phases(prompts, blocks, args.block_size)
    if full_at is None:
        print("  the pool never filled: raise --requests or lower --blocks")
        return
    fill, full = statistics.fmean(times[:full_at]), statistics.fmean(times[full_at:])
    print(f"  filling           {fill * 1e6:10.1f}  us/request (requests 0-{full_at - 1})")
    print(
        f"  full              {full * 1e6:10.1f}  us/request (requests {full_at}-{requests - 1}, "
        f"{mgr.stats.evicted_blocks:,} blocks evicted)"
    )
    print(f"  full / filling    {full / fill:10.2f}  (target <= 2)")
    # the later requests are longer (chats grow turn by turn): the same ratio per prompt token
    lengths = [len(p) for p in prompts]
    fill_tokens = statistics.fmean(lengths[:full_at])
    full_tokens = statistics.fmean(lengths[full_at:])
    fill_per, full_per = fill / fill_tokens * 1e9, full / full_tokens * 1e9
    print(
        f"  per 1k tokens     {fill_per:10.1f} / {full_per:.1f} us filling / full (prompts "
        f"{fill_tokens:,.0f} / {full_tokens:,.0f} tokens on average; "
        f"ratio {full_per / fill_per:.2f})"
    )
    del mgr
    gc.collect()
    same = scale_phases(prompts, 2**62, args.block_size)[0]
    unbounded = statistics.fmean(same[full_at:])
    print(
        f"  never full        {unbounded * 1e6:10.1f}  us/request (the same requests on a pool "
        f"that never fills; full / never full {full / unbounded:.2f})"
    )


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=None, help="default 2000 (--scale: 20000)")
    ap.add_argument("--blocks", type=int, default=None, help="default 20000 (--scale: 200000)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", action="store_true", help="the cost per request as the pool fills")
    args = ap.parse_args()
    if args.scale:
        scale(args)
        return
    args.requests = args.requests or 2000
    args.blocks = args.blocks or 20_000
    prompts = shared_prompt_workload(args.requests)
    tokens = sum(len(p) for p in prompts)
    print(
        f"workload: {len(prompts)} requests, {tokens:,} prompt tokens, "
        f"block_size={args.block_size}, pool={args.blocks} blocks"
    )
    measure_memory(prompts, args.blocks, args.block_size)  # first, while the process is fresh

    lists = [p.tolist() for p in prompts]
    times, list_times, base_times = [], [], []
    for _ in range(args.repeats):  # interleaved, so all see the same machine noise
        gc.collect()
        dt, mgr = run(prompts, args.blocks, args.block_size)
        times.append(dt)
        gc.collect()
        list_times.append(run(lists, args.blocks, args.block_size)[0])
        gc.collect()
        dt, base = run_baseline(prompts, args.blocks, args.block_size)
        base_times.append(dt)
    med, base_med = statistics.median(times), statistics.median(base_times)
    list_med = statistics.median(list_times)
    st = mgr.stats
    print(
        f"  requests/s        {len(prompts) / med:10,.0f}  (median of {args.repeats}; "
        f"min {len(prompts) / max(times):,.0f}, max {len(prompts) / min(times):,.0f})"
    )
    print(f"  us/request        {med / len(prompts) * 1e6:10.1f}")
    print(
        f"  requests/s, lists {len(prompts) / list_med:10,.0f}  (Python list input; "
        f"{base_med / list_med:.1f}x the baseline)"
    )
    convert_rows(lists)
    print(
        f"  baseline req/s    {len(prompts) / base_med:10,.0f}  (per-block dict, sha256 of "
        f"pickled tokens; speedup {base_med / med:.1f}x)"
    )
    print(
        f"  token hit rate    {st.token_hit_rate:10.4f}  (baseline "
        f"{base.hit_tokens / base.prompt_tokens:.4f}; infinite cache, full blocks "
        f"{infinite_cache_hit_rate(prompts, args.block_size):.4f})"
    )
    print(f"  evicted blocks    {st.evicted_blocks:10,}")


def plain_numpy_conversion(tokens: list[int]) -> np.ndarray:
    """The general path: infer the dtype, check the range, cast to int32."""
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 2**31 - 1:
        raise ValueError("bad token ids")
    return np.ascontiguousarray(arr, dtype="<i4")


def convert_rows(lists: list[list[int]]) -> None:
    longest = max(lists, key=len)
    timings = {}
    for name, fn in (("validated", as_token_array), ("plain numpy", plain_numpy_conversion)):
        reps = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(200):
                fn(longest)
            reps.append((time.perf_counter() - t0) / 200)
        timings[name] = statistics.median(reps)
    print(
        f"  list -> tokens    {timings['validated'] * 1e6:10.1f}  us for {len(longest):,} tokens "
        f"(np.asarray + checks + cast: {timings['plain numpy'] * 1e6:.1f} us, "
        f"{timings['plain numpy'] / timings['validated']:.2f}x)"
    )


if __name__ == "__main__":
    main()
