"""store_kv: new K/V land exactly in their slots; skipped (-1) and unowned slots stay untouched."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import interpreter_enabled, paged_attention, store_kv
from prefixcache.kernels.reference import reference_store_kv
from prefixcache.kernels.testing import make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
DTYPES = [torch.float32, torch.float16]
if DEVICE == "cuda":
    DTYPES.append(torch.bfloat16)


def _caches(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype):
    shape = (num_blocks, block_size, hkv, d)
    k = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return k, k.clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_size", "hkv", "d", "slot_dtype"),
    [(16, 2, 64, torch.int64), (32, 1, 128, torch.int32), (8, 4, 80, torch.int64)],
    ids=["p16-h2-d64-i64", "p32-h1-d128-i32", "p8-h4-d80-i64"],
)
def test_store_matches_reference(
    dtype: torch.dtype, block_size: int, hkv: int, d: int, slot_dtype: torch.dtype
) -> None:
    """Exact copy (no arithmetic), including head dims that are not a power of two."""
    gen = torch.Generator().manual_seed(block_size + hkv)
    num_blocks, n = 6, 45
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[3, 17, 44]] = -1  # padding tokens
    slots = slots.to(device=DEVICE, dtype=slot_dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(device=DEVICE, dtype=dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(device=DEVICE, dtype=dtype)
    k_cache, v_cache = _caches(num_blocks, block_size, hkv, d, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    reference_store_kv(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    written = int((slots >= 0).sum()) * hkv * d
    assert int((~k_cache.isnan()).sum()) == written  # nothing else was touched


def test_store_then_attend_over_strided_inputs() -> None:
    """Store from non-contiguous k/v views (fused qkv projection), then attend over the cache."""
    src = make_paged_batch(
        [21, 4], [5, 4], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE
    )
    fresh_k = torch.full_like(src.k_cache, float("nan"))
    fresh_v = torch.full_like(src.v_cache, float("nan"))
    for b in range(2):
        kv = torch.stack([src.keys[b], src.values[b]], dim=1)  # [n, 2, Hkv, D]: k/v strided views
        store_kv(kv[:, 0], kv[:, 1], fresh_k, fresh_v, src.slot_mapping(b))
    args = (src.block_tables, src.seq_lens, src.query_start_loc)
    expected = paged_attention(src.q, src.k_cache, src.v_cache, *args)
    torch.testing.assert_close(paged_attention(src.q, fresh_k, fresh_v, *args), expected)


def test_store_empty_and_all_skipped() -> None:
    k_cache, v_cache = _caches(2, 8, 1, 64, torch.float32)
    empty = torch.empty(0, 1, 64, device=DEVICE)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    k = torch.randn(3, 1, 64, device=DEVICE)
    store_kv(k, k, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()
