"""Hash-chain throughput: 16-token blocks from one int32 buffer, per algorithm, one core.

    python bench/hash_throughput.py [--tokens 2000000] [--repeats 7]

Prints the median of the repeats in M tokens/s, and a naive baseline measured in the same run
(a per-block ``np.array(list)`` conversion plus a pickle-free bytes join, as many block hashers do)
so the ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace


def naive_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """Baseline: per-block list slice -> numpy -> bytes, sha256 of parent + bytes."""
    out, parent = [], b"\0" * 16
    for i in range(0, len(tokens) - block_size + 1, block_size):
        block = np.array(tokens[i : i + block_size], dtype=np.int32).tobytes()
        parent = hashlib.sha256(parent + block).digest()[:16]
        out.append(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tokens = (
        np.random.default_rng(0).integers(0, 128_000, args.tokens, dtype=np.int64).astype("<i4")
    )
    ns = Namespace(model="bench")
    print(
        f"hash chain, block_size={args.block_size}, {args.tokens:,} tokens, median of "
        f"{args.repeats}"
    )
    for algo in ("xxh3_128", "sha256"):
        hasher = BlockHasher(args.block_size, algo)
        times, floor = [], []
        # the floor: the bare hash call on one block's input, nothing else, same count
        inputs = [bytes(16 + 8 + 4 * args.block_size)] * (args.tokens // args.block_size)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hasher.hash_prompt(tokens, ns)
            times.append(time.perf_counter() - t0)
            digest = hasher.digest
            t0 = time.perf_counter()
            for data in inputs:
                digest(data)
            floor.append(time.perf_counter() - t0)
        rate, floor_rate = (args.tokens / statistics.median(t) / 1e6 for t in (times, floor))
        print(
            f"  {algo:9s} {rate:7.1f} M tokens/s   (bare hash calls alone: {floor_rate:.1f}; "
            f"{rate / floor_rate:.0%} of that)"
        )
    as_list = tokens[: args.tokens // 4].tolist()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        naive_chain(as_list, args.block_size)
        times.append(time.perf_counter() - t0)
    print(
        f"  baseline  {len(as_list) / statistics.median(times) / 1e6:7.1f} M tokens/s "
        "(per-block list->numpy, sha256)"
    )


if __name__ == "__main__":
    main()
