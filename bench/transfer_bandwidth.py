"""Bandwidth of the K/V block transfers: batched against block by block against one plain copy.

    python bench/transfer_bandwidth.py [--blocks 1,4,16,64,256] [--repeats 7] [--json FILE]

On the device present (a CUDA GPU when there is one, else the CPU), for runs of N blocks of
8 layers of [16 tokens, 8 KV heads, 128] fp16 K and V (0.5 MiB a block), each direction alone:

- ``start_transfers`` of N offloads (device -> host) or N loads (host -> device), batched
  (``transfer_mode="auto"``; the mode it picked is printed) and block by block
  (``transfer_mode="blocks"``, one copy per block, layer and K/V: what it did before);
- a shared store's path, N whole blocks between host rows (records with a 64-byte header) and
  the paged K/V: ``write_block_rows`` (loads) and ``read_block_rows`` (write-through), against
  the per-block, per-layer copies the store connector ran before;
- the baseline: one plain copy of the same bytes, between one pinned host buffer and one device
  buffer on a GPU (the pinned-copy bandwidth), between two buffers on the CPU.

Ids come in three patterns: ``contiguous`` (consecutive host slots and GPU blocks), ``host-run``
(consecutive host slots, scattered GPU blocks: one staged gather or scatter) and ``scattered``
(both scattered). The methods alternate within each of ``--repeats`` repeats (after one warm-up
each; each repeat starts with the next method, so none always runs after the same one, on caches
it left), so all see the same machine. Prints GB/s (of the median time), the share of the baseline
and, for the batched paths, the speed-up over block by block: each the median over the repeats of
that repeat's ratio, so a slow stretch of a shared machine weighs on both sides of a ratio. On a
GPU, also whether the batched path reaches 80% of the pinned-copy bandwidth for runs of 16 blocks
and more in both directions (contiguous and host-run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from prefixcache import PagedKVCache
from prefixcache.kv_transfer import block_rows_view, plan_pairs, resolve_mode

LAYERS, P, HKV, D = 8, 16, 8, 128
DTYPE = torch.float16
HEADER = 64  # a store record's header ahead of its payload
TARGET = 0.8  # share of the pinned-copy bandwidth, runs of >= 16 blocks (a GPU target)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def ids(pattern: str, n: int, size: int, rng: np.random.Generator) -> tuple[list, list]:
    """(host slots, device blocks) of ``n`` transfers among ``size`` of each."""
    if pattern == "contiguous":
        return list(range(n, 2 * n)), list(range(2 * n, 3 * n))
    if pattern == "host-run":
        return list(range(n, 2 * n)), rng.permutation(size)[:n].tolist()
    return rng.permutation(size)[:n].tolist(), rng.permutation(size)[:n].tolist()


class Case:
    """One run size on one device: the cache, a baseline pair of buffers, the store rows."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n, self.device = n, device
        size = 4 * n
        self.kv = PagedKVCache(
            LAYERS, size, P, HKV, D, dtype=DTYPE, device=device, fill=1.0, host_blocks=size
        )
        for t in (*self.kv.k_host, *self.kv.v_host):
            t.fill_(2.0)
        self.nbytes = n * PagedKVCache.bytes_per_block(LAYERS, P, HKV, D, DTYPE.itemsize)
        pin = device.type == "cuda"
        self.host_buf = torch.ones(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev_buf = torch.ones(self.nbytes, dtype=torch.uint8, device=device)
        row = HEADER + self.kv.block_row_bytes
        self.rows = torch.ones((n, row), dtype=torch.uint8, pin_memory=pin)

    def baseline(self, direction: str) -> None:
        if direction == "load":
            self.dev_buf.copy_(self.host_buf, non_blocking=True)
        else:
            self.host_buf.copy_(self.dev_buf, non_blocking=True)

    def transfers(self, direction: str, mode: str, host: list, dev: list) -> None:
        kv = self.kv
        kv.transfer_mode = mode  # type: ignore[assignment]
        if direction == "load":
            kv.start_transfers(([], list(zip(host, dev, strict=True))))
        else:
            kv.start_transfers((list(zip(dev, host, strict=True)), []))
        for layer in range(LAYERS):
            kv.wait_transfers(layer)

    def store_rows(self, direction: str, batched: bool, dev: list) -> None:
        kv = self.kv
        if batched:
            kv.transfer_mode = "auto"
            if direction == "load":  # reused: each timing waits for the device
                kv.write_block_rows(dev, self.rows, HEADER)
            else:
                kv.read_block_rows(dev, self.rows, HEADER)
            return
        payload = block_rows_view(self.rows, HEADER, LAYERS, kv.k[0])  # the earlier copies
        for i, b in enumerate(dev):
            for layer in range(LAYERS):
                if direction == "load":
                    kv.k[layer][b].copy_(payload[i, layer, 0])
                    kv.v[layer][b].copy_(payload[i, layer, 1])
                else:
                    payload[i, layer, 0].copy_(kv.k[layer][b])
                    payload[i, layer, 1].copy_(kv.v[layer][b])


def measure(n: int, device: torch.device, repeats: int, out: list[dict]) -> None:
    case = Case(n, device)
    rng = np.random.default_rng(n)
    for direction in ("load", "offload"):
        for pattern in ("contiguous", "host-run", "scattered"):
            host, dev = ids(pattern, n, 4 * n, rng)
            methods: dict[str, Callable[[], None]] = {
                "baseline": lambda d=direction: case.baseline(d),
                "batched": lambda d=direction, h=host, g=dev: case.transfers(d, "auto", h, g),
                "per-block": lambda d=direction, h=host, g=dev: case.transfers(d, "blocks", h, g),
            }
            if pattern != "contiguous":  # store rows: only the GPU blocks' pattern counts
                methods["store batched"] = lambda d=direction, g=dev: case.store_rows(d, True, g)
                methods["store per-block"] = lambda d=direction, g=dev: case.store_rows(d, False, g)
            times: dict[str, list[float]] = {name: [] for name in methods}
            for fn in methods.values():
                timed(fn, device)  # warm-up
            order = list(methods)
            for i in range(repeats):  # each repeat starts one method later: none always
                for name in order[i % len(order) :] + order[: i % len(order)]:  # follows another
                    times[name].append(timed(methods[name], device))
            picked = _picked(case, host, dev)
            versus = {"batched": "per-block", "store batched": "store per-block"}
            for name, ts in times.items():
                rate = case.nbytes / statistics.median(ts)
                share = _speed_ratio(ts, times["baseline"])
                speedup = _speed_ratio(ts, times[versus[name]]) if name in versus else None
                row = {
                    "device": device.type,
                    "blocks": n,
                    "direction": direction,
                    "pattern": pattern,
                    "method": name,
                    "mode": picked if name == "batched" else None,
                    "bytes": case.nbytes,
                    "gb_s": round(rate / 1e9, 3),
                    "of_baseline": round(share, 3),
                    "speedup": None if speedup is None else round(speedup, 3),
                    "median_s": statistics.median(ts),
                }
                out.append(row)
                mode = f" ({picked})" if name == "batched" else ""
                faster = "" if speedup is None else f", {speedup:5.2f}x block by block"
                print(
                    f"{device.type:4} {n:4} blocks {direction:7} {pattern:10} {name + mode:24} "
                    f"{rate / 1e9:7.2f} GB/s {share:6.0%} of the baseline{faster}"
                )


def _speed_ratio(times: list[float], reference: list[float]) -> float:
    """The median over the repeats of repeat ``i``'s speed relative to the reference's:
    ``reference[i] / times[i]``."""
    return statistics.median(r / t for t, r in zip(times, reference, strict=True))


def _picked(case: Case, host: list, dev: list) -> str:
    """The mode ``"auto"`` picks for these pairs on this device."""
    return resolve_mode("auto", plan_pairs(host, dev), case.device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1,4,16,64,256", help="run sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write one JSON line per figure to this file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(
        f"{LAYERS} layers of [{P}, {HKV}, {D}] {str(DTYPE).removeprefix('torch.')} K and V, ",
        end="",
    )
    print(f"{PagedKVCache.bytes_per_block(LAYERS, P, HKV, D, DTYPE.itemsize) >> 10} KiB a block")
    out: list[dict] = []
    for n in (int(x) for x in args.blocks.split(",")):
        measure(n, device, args.repeats, out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":  # the target, per pattern with runs of host slots
        for pattern in ("contiguous", "host-run"):
            shares = [
                r["of_baseline"]
                for r in out
                if r["method"] == "batched" and r["blocks"] >= 16 and r["pattern"] == pattern
            ]
            if shares:
                verdict = "met" if min(shares) >= TARGET else "missed"
                print(
                    f"target >= {TARGET:.0%} of the pinned copy, runs >= 16 blocks, both "
                    f"directions, {pattern}: {verdict} (lowest {min(shares):.0%})"
                )
    if args.json:
        with open(args.json, "a") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
