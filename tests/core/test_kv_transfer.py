"""Batched block copies land the same bytes as copying block by block in order.

``start_transfers`` in every transfer mode against a per-block reference (the copies it used to
run: per layer, K then V, every offload then every load, a slot or block written twice keeping
the last) on random K/V in fp32, bf16, fp16 and fp8; runs of consecutive ids on both sides, on
one side only, scattered ids, offloads and loads in one step, a block offloaded and reloaded in
one step, a slot offloaded and loaded back in one step, duplicates; each layer checked after its
own wait. Then the whole-block rows a store's loads and write-through use
(``write_block_rows`` / ``read_block_rows``), against the same reference, and their checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache import ConfigError, InvalidArgumentError, PagedKVCache
from prefixcache.kv_transfer import block_rows_view, plan_pairs, resolve_mode

MODES = ["auto", "runs", "staged", "blocks"]
DTYPES = ["float32", "bfloat16", "float16", "fp8"]
# on a GPU machine the same checks run against the CUDA paths too (streams, events, DMAs)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NUM_BLOCKS, HOST_BLOCKS, P, H, D, LAYERS = 40, 48, 4, 2, 8, 3


def cache(dtype: str, seed: int = 0, device: str = "cpu") -> PagedKVCache:
    """K/V with random bytes on the GPU side and on host (every layer different)."""
    kw: dict = {"kv_dtype": "fp8"} if dtype == "fp8" else {"dtype": getattr(torch, dtype)}
    kv = PagedKVCache(LAYERS, NUM_BLOCKS, P, H, D, host_blocks=HOST_BLOCKS, device=device, **kw)
    gen = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v, *kv.k_host, *kv.v_host):
        raw = torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        values = raw.view(t.dtype)
        if t.dtype.is_floating_point:  # no NaN: compare values, not only bytes
            values = values.nan_to_num(0.0)
        t.copy_(values)
    return kv


def tensors(kv: PagedKVCache) -> list[torch.Tensor]:
    return [*kv.k, *kv.v, *kv.k_host, *kv.v_host]


def reference(kv: PagedKVCache, offloads, loads) -> list[torch.Tensor]:
    """Every tensor after the transfers, copied block by block as before batching."""
    ks, vs = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
    khs, vhs = [t.clone() for t in kv.k_host], [t.clone() for t in kv.v_host]
    off = {host: gpu for gpu, host in offloads}
    load = {gpu: host for host, gpu in loads}
    for layer in range(kv.num_layers):
        for gpu_t, host_t in ((ks[layer], khs[layer]), (vs[layer], vhs[layer])):
            for host, gpu in off.items():
                host_t[host].copy_(gpu_t[gpu])
            for gpu, host in load.items():
                gpu_t[gpu].copy_(host_t[host])
    return [*ks, *vs, *khs, *vhs]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def scattered(rng: np.random.Generator, n: int, size: int) -> list[int]:
    return rng.permutation(size)[:n].tolist()


def patterns() -> dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """(offloads as (gpu, host), loads as (host, gpu)) by name."""
    rng = np.random.default_rng(7)
    g, h = scattered(rng, 30, NUM_BLOCKS), scattered(rng, 30, HOST_BLOCKS)
    return {
        "one run both sides": ([(5 + i, 20 + i) for i in range(16)], []),
        "loads, one run both sides": ([], [(3 + i, 9 + i) for i in range(16)]),
        "host run, scattered blocks": (list(zip(g[:16], range(30, 46), strict=True)), []),
        "loads, host run, scattered blocks": ([], list(zip(range(8, 24), g[:16], strict=True))),
        "scattered": (
            list(zip(g[:12], h[:12], strict=True)),
            list(zip(h[12:24], g[12:24], strict=True)),
        ),
        "runs and singles": (
            [(0, 10), (1, 11), (2, 12), (9, 13), (20, 30), (21, 31), (7, 2)],
            [(40, 30), (41, 31), (42, 32), (5, 35), (44, 20), (45, 22)],
        ),
        "runs in reverse order": (
            [(10 - i, 20 - i) for i in range(8)],
            [(40 - i, 30 - i) for i in range(8)],
        ),
        # the block an offload reads is loaded into in the same step (freed, then reused)
        "block offloaded then reloaded": ([(4, 0), (5, 1), (6, 2)], [(10, 4), (11, 5), (12, 6)]),
        # a slot offloaded and loaded back into another block in the same step
        "slot offloaded then loaded": ([(4, 0), (5, 1)], [(0, 20), (1, 21), (2, 22)]),
        # a slot written twice keeps the last, a block loaded twice keeps the last
        "duplicates": ([(1, 3), (2, 3), (3, 4)], [(5, 9), (6, 9), (7, 10), (7, 11)]),
        "two hosts into one run": ([], [(0, 0), (0, 1), (1, 2), (1, 3)]),
        "one block": ([(39, 47)], [(47, 39)]),
        "nothing": ([], []),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(patterns()))
def test_start_transfers_lands_what_block_by_block_copies_land(device, mode, dtype, name):
    offloads, loads = patterns()[name]
    kv = cache(dtype, device=device)
    want = reference(kv, offloads, loads)
    kv.transfer_mode = mode
    kv.start_transfers((offloads, loads, []))
    for layer in range(kv.num_layers):  # each layer after its own wait
        kv.wait_transfers(layer)
        for got, ref in (
            (kv.k[layer], want[layer]),
            (kv.v[layer], want[LAYERS + layer]),
            (kv.k_host[layer], want[2 * LAYERS + layer]),
            (kv.v_host[layer], want[3 * LAYERS + layer]),
        ):
            assert same(got, ref), f"layer {layer} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_random_steps_in_a_row_match_block_by_block(device, mode):
    """Twenty steps of random offloads and loads, some sharing blocks and slots, on one cache
    against the reference applied step by step, with no wait between steps."""
    rng = np.random.default_rng(11)
    kv = cache("bfloat16", seed=3, device=device)
    kv.transfer_mode = mode
    ref = PagedKVCache(LAYERS, NUM_BLOCKS, P, H, D, dtype=torch.bfloat16, host_blocks=HOST_BLOCKS)
    for t, s in zip(tensors(ref), tensors(kv), strict=True):
        t.copy_(s)
    for step in range(20):
        n_off, n_load = int(rng.integers(0, 20)), int(rng.integers(0, 20))
        start_g, start_h = (
            int(rng.integers(0, NUM_BLOCKS - 20)),
            int(rng.integers(0, HOST_BLOCKS - 20)),
        )
        if rng.random() < 0.5:  # runs
            offloads = [(start_g + i, start_h + i) for i in range(n_off)]
            loads = [
                (int(rng.integers(0, HOST_BLOCKS)), int(g))
                for g in scattered(rng, n_load, NUM_BLOCKS)
            ]
        else:
            offloads = list(
                zip(
                    scattered(rng, n_off, NUM_BLOCKS),
                    scattered(rng, n_off, HOST_BLOCKS),
                    strict=True,
                )
            )
            loads = [(start_h + i, start_g + i) for i in range(n_load)]
        ref.transfer_mode = "blocks"
        ref.start_transfers((offloads, loads))
        kv.start_transfers((offloads, loads))
        if step % 2:  # every other step back to back, without waiting
            for layer in range(LAYERS):
                kv.wait_transfers(layer)
            if device == "cuda":  # the host tensors are read by the host below
                torch.cuda.synchronize()
            assert all(same(a, b) for a, b in zip(tensors(kv), tensors(ref), strict=True))


def test_plans_sort_by_host_and_find_runs():
    pairs = plan_pairs([7, 3, 4, 5, 9, 8], [1, 10, 11, 30, 2, 2])
    assert pairs.host == [3, 4, 5, 7, 8, 9] and pairs.device == [10, 11, 30, 1, 2, 2]
    assert pairs.host_runs == [(0, 3), (3, 3)]
    assert pairs.both_runs == [(0, 2), (2, 1), (3, 2), (5, 1)]  # 7->1, 8->2 run on
    # auto: one copy per run on the CPU; on a GPU, staged when it needs fewer DMAs
    assert resolve_mode("auto", pairs, on_cuda=False) == "runs"
    assert resolve_mode("auto", pairs, on_cuda=True) == "staged"
    both = plan_pairs(range(8, 24), range(16))
    assert both.host_runs == both.both_runs == [(0, 16)]
    assert resolve_mode("auto", both, on_cuda=True) == "runs"
    assert resolve_mode("blocks", both, on_cuda=True) == "blocks"
    assert len(plan_pairs([], [])) == 0


def test_small_and_large_plans_agree(monkeypatch):
    """Plans of a few pairs are made in plain Python, larger ones with numpy: the same plans."""
    import prefixcache.kv_transfer as kv_transfer

    rng = np.random.default_rng(3)
    cases = []
    for _ in range(400):
        n = int(rng.integers(0, 40))
        host = rng.integers(0, 50, n).tolist()
        if rng.random() < 0.5:  # runs, shuffled, sometimes with runs on the device side too
            host = (int(rng.integers(0, 10)) + rng.permutation(n)).tolist()
        device = [h + 3 for h in host] if rng.random() < 0.3 else rng.integers(0, 50, n).tolist()
        cases.append((host, device, plan_pairs(host, device)))
    monkeypatch.setattr(kv_transfer, "_SMALL", -1)
    for host, device, small in cases:
        assert plan_pairs(host, device) == small


def test_a_bad_mode_is_a_config_error():
    kv = PagedKVCache(1, 2, 4, 1, 8, host_blocks=2)
    with pytest.raises(ConfigError, match="transfer_mode"):
        kv.transfer_mode = "fast"  # type: ignore[assignment]
    assert kv.transfer_mode == "auto"


# ---- whole-block rows: a store's loads and write-through ------------------------------------
HEADER = 48  # a record's header ahead of the payload, as the store's records have


def rows_reference_write(kv: PagedKVCache, blocks, rows, offset) -> list[torch.Tensor]:
    """The tensors after copying each row into its block, layer by layer, block by block."""
    out = [t.clone() for t in tensors(kv)]
    ks, vs = out[:LAYERS], out[LAYERS : 2 * LAYERS]
    dtype = kv.k[0].dtype
    for i, b in enumerate(blocks):
        payload = rows[i, offset : offset + kv.block_row_bytes].view(dtype)
        payload = payload.view(LAYERS, 2, *kv.k[0].shape[1:])
        for layer in range(LAYERS):
            ks[layer][b].copy_(payload[layer, 0])
            vs[layer][b].copy_(payload[layer, 1])
    return out


def random_rows(kv: PagedKVCache, n: int, offset: int, seed: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(
        0, 256, (n, offset + kv.block_row_bytes + 16), generator=gen, dtype=torch.uint8
    )
    if kv.k[0].dtype.is_floating_point:
        payload = block_rows_view(rows, offset, LAYERS, kv.k[0])
        payload.copy_(payload.nan_to_num(0.0))
    return rows


ROW_BLOCKS = {
    "run": list(range(10, 26)),
    "scattered": [33, 2, 17, 5, 30, 11, 0, 39],
    "mixed": [4, 5, 6, 20, 21, 1, 38, 39],
    "twice": [3, 8, 3, 9],  # block 3 keeps its last row
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROW_BLOCKS))
def test_block_rows_land_what_block_by_block_copies_land(device, mode, dtype, name):
    blocks = ROW_BLOCKS[name]
    kv = cache(dtype, device=device)
    kv.transfer_mode = mode
    rows = random_rows(kv, len(blocks), HEADER)
    want = rows_reference_write(kv, blocks, rows, HEADER)
    before = rows.clone()
    kv.write_block_rows(blocks, rows, HEADER)
    for layer in range(LAYERS):
        kv.wait_transfers(layer)
    assert torch.equal(rows, before)
    assert all(same(a, b) for a, b in zip(tensors(kv), want, strict=True))
    # and read back: every row's payload is its block's, the header bytes untouched
    back = torch.zeros_like(rows)
    kv.read_block_rows(blocks, back, HEADER)
    assert not back[:, :HEADER].any() and not back[:, HEADER + kv.block_row_bytes :].any()
    last = {b: i for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        got = back[i, HEADER : HEADER + kv.block_row_bytes]
        assert torch.equal(got, rows[last[b], HEADER : HEADER + kv.block_row_bytes])
        for layer in range(LAYERS):
            payload = got.view(kv.k[0].dtype).view(LAYERS, 2, *kv.k[0].shape[1:])
            assert same(payload[layer, 0], kv.k[layer][b]) and same(
                payload[layer, 1], kv.v[layer][b]
            )


def test_block_rows_without_a_header_and_without_a_host_tier():
    kv = PagedKVCache(2, 8, 4, 1, 8, dtype=torch.float16)
    for t in (*kv.k, *kv.v):
        t.normal_()
    rows = kv.host_rows(3, kv.block_row_bytes)
    kv.read_block_rows([6, 0, 7], rows)
    copy = PagedKVCache(2, 8, 4, 1, 8, dtype=torch.float16)
    copy.write_block_rows([1, 2, 3], rows)
    for layer in range(2):
        assert torch.equal(copy.k[layer][1:4], kv.k[layer][[6, 0, 7]])
        assert torch.equal(copy.v[layer][1:4], kv.v[layer][[6, 0, 7]])
        assert not copy.k[layer][4:].any()


def test_bad_rows_are_typed_errors_and_change_nothing():
    kv = cache("float16")
    before = [t.clone() for t in tensors(kv)]
    need = kv.block_row_bytes
    good = torch.zeros((2, need), dtype=torch.uint8)
    for blocks, rows, offset in (
        ([0, 40], good, 0),  # a block outside the cache
        ([0, -1], good, 0),
        ([0, 1.5], good, 0),
        ([0], good, 0),  # one row too many
        ([0, 1], good.view(torch.float16), 0),  # not bytes
        ([0, 1], good[:, :-2], 0),  # too short
        ([0, 1], good, 2),  # short by the offset
        ([0, 1], torch.zeros((2, need + 1), dtype=torch.uint8), 1),  # misaligned for fp16
        ([0, 1], good, True),
        ([0, 1], good.t(), 0),
        ([0, 1], "rows", 0),
    ):
        for call in (kv.write_block_rows, kv.read_block_rows):
            with pytest.raises(InvalidArgumentError):
                call(blocks, rows, offset)  # type: ignore[arg-type]
    assert all(same(a, b) for a, b in zip(tensors(kv), before, strict=True))
    kv.write_block_rows([], torch.zeros((0, need), dtype=torch.uint8))  # nothing to do
