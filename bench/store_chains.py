"""What a full one-host store keeps: the share of its blocks that no query can reach.

    python bench/store_chains.py [--requests 600] [--capacity-mib 1]

A runtime (CacheManager, KVStoreConnector, an LMDB store in a temporary directory) serves
prompts over shared system prompts (Zipf popularity) with 1-3 blocks of their own, through a
store that holds a few dozen records, so it evicts all the time. For a GPU pool that keeps
little, one that keeps the popular system prompts, and one that keeps them all, it prints the
blocks held at the end, those that sit after a block of their chain the store no longer holds
(a query stops there: they can never be loaded), and the blocks loaded from the store on the
way. It uses only what every version of the store has, so the same file measures another
checkout: ``PYTHONPATH=<checkout> python bench/store_chains.py``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

import numpy as np
import torch

from prefixcache import CacheManager, Namespace, PagedKVCache
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.lmdb import LMDBBlockStore

NS = Namespace(model="bench")
BLOCK = 16
SETUPS = (  # GPU blocks, system prompts, blocks each
    (32, 24, 6),
    (128, 24, 6),
    (256, 8, 12),
)


def workload(requests: int, systems: int, blocks: int) -> list[list[int]]:
    """Prompts: a system prompt (Zipf popularity) and 1-3 blocks of their own."""
    rng = np.random.default_rng(7)
    heads = [rng.integers(0, 1000, blocks * BLOCK).tolist() for _ in range(systems)]
    popularity = 1.0 / np.arange(1, systems + 1)
    popularity /= popularity.sum()
    return [
        heads[int(rng.choice(systems, p=popularity))]
        + rng.integers(0, 1000, int(rng.integers(1, 4)) * BLOCK).tolist()
        + [1]
        for _ in range(requests)
    ]


def serve(gpu_blocks: int, prompts: list[list[int]], capacity: int) -> tuple[int, int, int]:
    """Blocks held at the end, how many of them are unreachable, and blocks loaded."""
    where = tempfile.mkdtemp(prefix="store-chains-")
    try:
        kv = PagedKVCache(1, gpu_blocks, BLOCK, 2, 64, dtype=torch.float32)  # 16 KiB records
        store = LMDBBlockStore(where, capacity_bytes=capacity)
        connector = KVStoreConnector(store, kv)
        mgr = CacheManager(gpu_blocks, BLOCK, stepped=True, store=connector)
        for i, tokens in enumerate(prompts):
            rid = f"r{i}"
            mgr.admit(rid, tokens, NS)
            transfers = mgr.take_transfers()
            for failed in connector.load(transfers.store_loads):
                if failed in mgr.requests:
                    mgr.abort(failed)
            mgr.end_step()
            connector.write_through(mgr.take_store_writes())
            connector.flush()
            if rid in mgr.requests:
                mgr.release(rid)
        held = set(store.keys())
        stranded: set[bytes] = set()
        for tokens in prompts:
            gone = False
            for digest in mgr.hasher.hash_prompt(tokens, NS):
                if digest not in held:
                    gone = True
                elif gone:
                    stranded.add(digest)
        loaded = connector.counters().loaded_blocks
        connector.close()
        return len(held), len(stranded), loaded
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="prompts served (default 600)")
    ap.add_argument(
        "--capacity-mib", type=int, default=1, help="the store's capacity in MiB (default 1)"
    )
    args = ap.parse_args()
    if args.requests < 1 or args.capacity_mib < 1:
        ap.error("--requests and --capacity-mib must be at least 1")
    print(f"{'GPU blocks':>10} {'systems':>9} {'held':>6} {'unreachable':>12} {'loaded':>7}")
    try:
        for gpu, systems, blocks in SETUPS:
            prompts = workload(args.requests, systems, blocks)
            held, stranded, loaded = serve(gpu, prompts, args.capacity_mib << 20)
            share = stranded / max(1, held)
            print(
                f"{gpu:10} {systems:4} x {blocks:2} {held:6} {stranded:6} ({share:4.0%}) {loaded:7}"
            )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
