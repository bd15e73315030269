"""The store connector's copies in and out of GPU blocks, batched, against block-by-block copies:
write-through records hold exactly each block's K and V of every layer, and loads put exactly
those bytes into their blocks (a block loaded twice in a step keeps the last, a failed load
leaves its block alone), on a real LMDB store, in fp32, bf16, fp16 and fp8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache import Namespace, PagedKVCache
from prefixcache.manager.lower_tiers.transfers import StoreLoad, StoreWrite

pytest.importorskip("lmdb")
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.lmdb import LMDBBlockStore

NS = Namespace(model="m")
LAYERS, BLOCKS, P, H, D = 3, 32, 4, 2, 8


# on a GPU machine the same checks run against the CUDA paths too, with and without a host tier
DEVICES = [("cpu", 0)] + ([("cuda", 0), ("cuda", 8)] if torch.cuda.is_available() else [])


def cache(dtype: str, seed: int, device: str = "cpu", host_blocks: int = 0) -> PagedKVCache:
    kw: dict = {"kv_dtype": "fp8"} if dtype == "fp8" else {"dtype": getattr(torch, dtype)}
    kv = PagedKVCache(LAYERS, BLOCKS, P, H, D, device=device, host_blocks=host_blocks, **kw)
    gen = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v):
        raw = torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        t.copy_(raw.view(t.dtype))
    return kv


def block_bytes(kv: PagedKVCache, block: int) -> bytes:
    """A block's K then V of each layer, block by block: a record's payload."""
    parts = []
    for layer in range(kv.num_layers):
        parts += [kv.k[layer][block], kv.v[layer][block]]
    return b"".join(bytes(p.cpu().contiguous().view(torch.uint8).numpy()) for p in parts)


def digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("device, host_blocks", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_write_through_and_loads_move_the_bytes_block_copies_move(
    tmp_path, dtype, device, host_blocks
):
    kv = cache(dtype, seed=1, device=device, host_blocks=host_blocks)
    sources = [3, 4, 5, 6, 20, 1, 31, 9, 10, 11]  # runs and scattered blocks
    want = {digest(i): block_bytes(kv, b) for i, b in enumerate(sources)}
    connector = KVStoreConnector(LMDBBlockStore(tmp_path / "kv", 16 << 20), kv)
    with connector:
        connector.write_through([StoreWrite(digest(i), b, NS) for i, b in enumerate(sources)])
        connector.flush()
        header = connector.layout.header_bytes
        buf = np.empty(connector.layout.record_bytes, dtype=np.uint8)
        for d, payload in want.items():  # each record: its block's bytes after the header
            n = connector.backend.get_into(d, buf.data)
            assert n == len(buf) and bytes(buf[header:]) == payload
        assert connector.counters().written_blocks == len(sources)

        before = [t.clone() for t in (*kv.k, *kv.v)]
        targets = [12, 13, 14, 15, 0, 27, 2, 22]
        loads = [StoreLoad(f"r{i % 3}", digest(i), b, NS) for i, b in enumerate(targets)]
        loads.insert(5, StoreLoad("gone", digest(99), 16, NS))  # not in the store
        loads.insert(6, StoreLoad("gone", digest(8), 17, NS))  # after its request failed
        loads.append(StoreLoad("r9", digest(9), 13, NS))  # block 13 again: the last wins
        assert connector.load(loads) == ["gone"]
        for layer in range(LAYERS):  # as a forward pass does (with a host tier, on CUDA)
            kv.wait_transfers(layer)
        assert connector.counters().loaded_blocks == len(targets) + 1
        landed = {b: digest(i) for i, b in enumerate(targets)} | {13: digest(9)}
        for b in range(BLOCKS):
            if b in landed:
                assert block_bytes(kv, b) == want[landed[b]], f"block {b}"
            else:  # untouched, 16 and 17 included
                for layer in range(LAYERS):
                    assert torch.equal(
                        kv.k[layer][b].view(torch.uint8), before[layer][b].view(torch.uint8)
                    )
                    assert torch.equal(
                        kv.v[layer][b].view(torch.uint8),
                        before[LAYERS + layer][b].view(torch.uint8),
                    )
        assert connector.load([]) == []


def host_bytes(kv: PagedKVCache, slot: int) -> bytes:
    parts = []
    for layer in range(kv.num_layers):
        parts += [kv.k_host[layer][slot], kv.v_host[layer][slot]]
    return b"".join(bytes(p.contiguous().view(torch.uint8).numpy()) for p in parts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an ordering of CUDA streams")
def test_a_store_load_waits_for_the_offload_that_reads_its_block(tmp_path):
    """A block offloaded to host and handed to a store load in the same step: the offload runs
    on the side stream, so the load must not write the block before the offload has read it
    (the loads used to run on the current stream, unordered with the side stream)."""
    kv = cache("float16", seed=2, device="cuda", host_blocks=8)
    with KVStoreConnector(LMDBBlockStore(tmp_path / "kv", 16 << 20), kv) as connector:
        connector.write_through([StoreWrite(digest(0), 5, NS)])
        connector.flush()
        stored, before = block_bytes(kv, 5), block_bytes(kv, 7)
        assert stored != before
        with torch.cuda.stream(kv._stream):  # the side stream busy: its offload starts late
            torch.cuda._sleep(500_000_000)
        kv.start_transfers(([(7, 3)], []))  # block 7 to host slot 3
        assert connector.load([StoreLoad("r", digest(0), 7, NS)]) == []  # block 7 reused
        for layer in range(LAYERS):
            kv.wait_transfers(layer)
        torch.cuda.synchronize()
        assert host_bytes(kv, 3) == before and block_bytes(kv, 7) == stored
