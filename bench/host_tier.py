"""The host tier's cost: manager time per admission with the tier on and off, and the K/V copy
bandwidth of ``PagedKVCache`` transfers.

    python bench/host_tier.py [--requests 4000] [--repeats 5] [--copies-only]

Manager: prompts from 64 families (an 8-block shared prefix and a 1-3 block private tail, 16-token
blocks) against a GPU pool of 256 blocks, which holds about a third of the working set, so most
admissions evict; with the tier (1,024 host blocks) evicted blocks are offloaded and hits on them
loaded. Each admission is admit, take_transfers, end_step, release (stepped). Prints the median
and the mean seconds per admission of each (the mean carries the admissions that evict and
offload), the tier's hit split, and the ratios; the two configurations alternate within one run.
Then, for the same admissions with and without the tier, split by whether the tier loaded blocks
for them: the time the tier adds and the blocks it moved (loaded, and offloaded to make room),
so what one block moved costs.

Copies: one ``start_transfers`` of 64 offloads and 64 loads across 8 layers of [16, 8, 128] fp16
K and V (0.5 MiB per block), on the CPU here (a CUDA device is used when there is one). On a GPU
also each direction alone (offloads: device to pinned host; loads: pinned host to device) and,
as the same run's ceiling, one 256 MiB copy each way between pinned host memory and the device.
``--copies-only`` skips the manager part.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import numpy as np
import torch

from prefixcache import CORE_BUILD, CacheManager, PagedKVCache
from prefixcache.manager.lower_tiers.transfers import Load, Offload, Transfers

P = 16


def workload(requests: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 50_000, 8 * P, dtype=np.int32) for _ in range(64)]
    out = []
    for _ in range(requests):
        family = int(rng.zipf(1.2)) % 64
        tail = rng.integers(0, 50_000, int(rng.integers(1, 4)) * P + 5, dtype=np.int32)
        out.append(np.concatenate([prefixes[family], tail]))
    return out


class Pass(NamedTuple):
    """One pass over the workload: each admission's seconds, and the blocks the tier loaded
    and offloaded for it."""

    seconds: list[float]
    loaded: list[int]
    offloaded: list[int]
    mgr: CacheManager


def per_admission(prompts: list[np.ndarray], host_blocks: int) -> Pass:
    """Time each admission (admit, take_transfers, end_step, release)."""
    mgr = CacheManager(256, P, stepped=True, host_blocks=host_blocks)
    out = Pass([], [], [], mgr)
    clock = time.perf_counter
    for i, prompt in enumerate(prompts):
        t0 = clock()
        mgr.admit(i, prompt)
        transfers = mgr.take_transfers()
        mgr.end_step()
        mgr.release(i)
        out.seconds.append(clock() - t0)
        out.loaded.append(len(transfers.loads))
        out.offloaded.append(len(transfers.offloads))
    return out


def copy_bandwidth(blocks: int, repeats: int, direction: str = "both") -> tuple[float, str]:
    """Bytes per second of one start_transfers of ``blocks`` offloads and ``blocks`` loads
    (``direction`` "offload" or "load": that direction's ``blocks`` alone)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, hkv, d = 8, 8, 128
    kv = PagedKVCache(
        layers, 4 * blocks, P, hkv, d, dtype=torch.float16, device=device, host_blocks=4 * blocks
    )
    rng = np.random.default_rng(0)
    best = float("inf")
    for _ in range(repeats):
        gpu = rng.permutation(4 * blocks)[: 2 * blocks].tolist()
        host = rng.permutation(4 * blocks)[: 2 * blocks].tolist()
        offloads = list(map(Offload, gpu[:blocks], host[:blocks]))
        loads = list(map(Load, host[blocks:], gpu[blocks:]))
        transfers = Transfers(
            offloads if direction != "load" else [], loads if direction != "offload" else []
        )
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        kv.start_transfers(transfers)
        for layer in range(layers):
            kv.wait_transfers(layer)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    moved = (1 if direction != "both" else 2) * blocks
    return moved * PagedKVCache.bytes_per_block(layers, P, hkv, d, 2) / best, device


def pinned_copy_bandwidth(nbytes: int, repeats: int) -> tuple[float, float]:
    """(host to device, device to host) bytes per second of one ``nbytes`` copy between pinned
    host memory and the GPU: the ceiling for the tier's transfers."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rates.append(nbytes / best)
    return rates[0], rates[1]


def print_copies(repeats: int) -> None:
    bandwidth, device = copy_bandwidth(64, repeats)
    print(f"start_transfers, 64 offloads + 64 loads on {device}: {bandwidth / 1e9:.2f} GB/s")
    if device != "cuda":
        return
    offload, _ = copy_bandwidth(64, repeats, "offload")
    load, _ = copy_bandwidth(64, repeats, "load")
    h2d, d2h = pinned_copy_bandwidth(256 << 20, repeats)
    print(
        f"start_transfers, one direction: 64 loads (pinned host -> device) {load / 1e9:.2f} GB/s "
        f"({load / h2d:.0%} of one 256 MiB copy, {h2d / 1e9:.2f} GB/s); 64 offloads (device -> "
        f"pinned host) {offload / 1e9:.2f} GB/s ({offload / d2h:.0%} of {d2h / 1e9:.2f} GB/s)"
    )


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copies-only", action="store_true", help="only the copy bandwidths")
    args = parser.parse_args()
    if args.copies_only:
        print_copies(args.repeats)
        return
    prompts = workload(args.requests)
    passes: dict[int, list[Pass]] = {0: [], 1024: []}
    for _ in range(args.repeats):  # alternate, so both see the same machine load
        for host_blocks, runs in passes.items():
            runs.append(per_admission(prompts, host_blocks))
    off = [statistics.median(p.seconds) for p in passes[0]]
    on = [statistics.median(p.seconds) for p in passes[1024]]
    off_mean = [statistics.fmean(p.seconds) for p in passes[0]]
    on_mean = [statistics.fmean(p.seconds) for p in passes[1024]]
    last = passes[1024][-1]
    mgr = last.mgr
    st = mgr.stats
    t_off, t_on = statistics.median(off), statistics.median(on)
    m_off, m_on = statistics.median(off_mean), statistics.median(on_mean)
    print(
        f"manager per admission, median: tier off {t_off * 1e6:.1f} us, tier on {t_on * 1e6:.1f} us"
    )
    print(
        f"manager per admission, mean:   tier off {m_off * 1e6:.1f} us, tier on {m_on * 1e6:.1f} us"
    )
    print(f"ratio on/off: {t_on / t_off:.2f} median, {m_on / m_off:.2f} mean (target <= 1.3)")
    print(
        f"tier on: hit blocks {st.hit_blocks} of {st.lookup_blocks} ({st.loaded_blocks} loaded "
        f"from host), offloaded {st.offloaded_blocks}, host evicted {st.host_evicted_blocks}"
    )
    # the same admissions with and without the tier (each one's median over the repeats),
    # split by whether the tier loaded blocks for it: what a block moved costs
    each_off = np.median(np.array([p.seconds for p in passes[0]]), axis=0) * 1e6
    each_on = np.median(np.array([p.seconds for p in passes[1024]]), axis=0) * 1e6
    loaded, offloaded = np.array(last.loaded), np.array(last.offloaded)
    for label, sel in (("admissions that load", loaded > 0), ("the others", loaded == 0)):
        t_off, t_on = each_off[sel].mean(), each_on[sel].mean()
        blocks = (loaded[sel] + offloaded[sel]).mean()
        print(
            f"{label} ({int(sel.sum())}): tier off {t_off:.1f} us, tier on {t_on:.1f} us "
            f"(+{t_on - t_off:.1f}); blocks moved {blocks:.1f} ({loaded[sel].mean():.1f} "
            f"loaded, {offloaded[sel].mean():.1f} offloaded), "
            f"{(t_on - t_off) / max(blocks, 1e-9):.2f} us a block"
        )
    gpu_hits = passes[0][-1].mgr.stats.hit_blocks
    print(f"tier off: hit blocks {gpu_hits} of {st.lookup_blocks}")
    print_copies(args.repeats)


if __name__ == "__main__":
    main()
