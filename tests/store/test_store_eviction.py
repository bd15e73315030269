"""What a full store keeps: blocks in use (a read refreshes a block as a write does), and whole
chains from their first block: a block whose chain parent is gone can never be loaded (a query
stops at the first block it does not find), so tails go before their heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache import CacheManager, Namespace, PagedKVCache
from prefixcache.manager.lower_tiers.transfers import StoreLoad, StoreWrite
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.lmdb import LMDBBlockStore

MIB = 1 << 20
NS = Namespace(model="m")
BLOCK = 16


def small_cache(num_blocks: int = 64) -> PagedKVCache:
    """One layer, 2 heads of 64 in fp32: a 16 KiB record a block."""
    return PagedKVCache(1, num_blocks, BLOCK, 2, 64, dtype=torch.float32)


def digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_a_prompt_read_before_every_write_survives(tmp_path):
    kv = small_cache()
    store = LMDBBlockStore(tmp_path / "kv", capacity_bytes=1 * MIB)  # about 60 records
    connector = KVStoreConnector(store, kv)
    try:
        prompt = [digest(i) for i in range(4)]
        connector.write_through([StoreWrite(d, i, NS) for i, d in enumerate(prompt)])
        connector.flush()
        fresh = 100
        for round_ in range(12):  # 12 x 16 new records: three times the store
            loads = [StoreLoad("r", d, 10 + i, NS) for i, d in enumerate(prompt)]
            assert connector.load(loads) == [], f"evicted by round {round_}"
            writes = [StoreWrite(digest(fresh + j), 20 + j, NS) for j in range(16)]
            fresh += 16
            connector.write_through(writes)
            connector.flush()
        assert store.evicted() > 0
        assert store.exists(prompt) == [True] * 4
    finally:
        connector.close()


def _serve(mgr: CacheManager, connector: KVStoreConnector, rid: str, tokens: list[int]) -> None:
    """One request through the documented step: admit, store loads, (forward), end the step,
    write through, release."""
    mgr.admit(rid, tokens, NS)
    transfers = mgr.take_transfers()
    mgr.abort_many(connector.load(transfers.store_loads))
    mgr.end_step()
    connector.write_through(mgr.take_store_writes())
    connector.flush()  # one background batch a step: the same store in every run
    if rid in mgr.requests:
        mgr.release(rid)


def _unreachable_share(
    mgr: CacheManager, store: LMDBBlockStore, prompts: list[list[int]]
) -> tuple[float, int]:
    """Of the blocks held, the share that sit after a block of their chain that is not held."""
    held = set(store.keys())
    tails = set()
    for tokens in prompts:
        gone = False
        for d in mgr.hasher.hash_prompt(tokens, NS):
            if d not in held:
                gone = True
            elif gone:
                tails.add(d)
    return len(tails) / max(1, len(held)), len(held)


@pytest.mark.parametrize("gpu_blocks, most", [(32, 0.0), (128, 0.05)])
def test_a_full_store_keeps_chains_from_their_heads(tmp_path, gpu_blocks, most):
    """Prompts over 24 system prompts of 6 blocks with 1-3 blocks of their own, served by a
    runtime through a store that holds a few of them. With a GPU pool that keeps little, every
    chain is held from its head (oldest-written first left 5% of the store stranded); with one
    that keeps the system prompts, the store sees mostly their continuations, and only blocks
    written just now without their head may be stranded (oldest-written first: 43%)."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 1000, 6 * BLOCK).tolist() for _ in range(24)]
    popularity = 1.0 / np.arange(1, 25)
    popularity /= popularity.sum()
    prompts = []
    for _ in range(600):
        s = int(rng.choice(24, p=popularity))
        own = int(rng.integers(1, 4)) * BLOCK
        prompts.append(systems[s] + rng.integers(0, 1000, own).tolist() + [1])
    kv = small_cache(gpu_blocks)
    store = LMDBBlockStore(tmp_path / "kv", capacity_bytes=1 * MIB)  # about 60 records
    connector = KVStoreConnector(store, kv)
    mgr = CacheManager(gpu_blocks, BLOCK, stepped=True, store=connector)
    try:
        for i, tokens in enumerate(prompts):
            _serve(mgr, connector, f"r{i}", tokens)
        assert store.evicted() > 1000
        share, held = _unreachable_share(mgr, store, prompts)
        assert held > 30
        assert share <= most, f"{share:.0%} of the {held} blocks held are unreachable tails"
    finally:
        connector.close()
