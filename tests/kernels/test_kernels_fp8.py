"""fp8 (e4m3, per-tensor scale) K/V cache: store_kv quantizes, paged_attention dequantizes on load.

Both the Triton store (interpreter on CPU) and the torch reference round to nearest even and
saturate at +-448, so the stored bytes are compared bit for bit. Attention over an fp8 cache is
compared two ways: with the reference over the dequantized cache (the same numbers, so fp32
1e-5), and with the fp32 truth over the unquantized K/V, where e4m3's 3 mantissa bits (relative
error <= 2**-4 per element) bound the error: for unit-variance K/V the mean absolute output error
is ~0.009 (asserted < 0.02) and the worst element ~0.13 (asserted < 0.25), the worst coming from
short sequences whose output is close to a single V row (its error up to 2**-4 * |v|).
"""

from __future__ import annotations

import pytest
import torch

from prefixcache import PagedKVCache
from prefixcache.kernels import (
    KernelDTypeError,
    KernelInputError,
    interpreter_enabled,
    paged_attention,
    store_kv,
)
from prefixcache.kernels.reference import dequantize_fp8, quantize_fp8, reference_store_kv
from prefixcache.kernels.testing import contiguous_attention, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"


def _hard_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), saturation, zeros."""
    exact = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = exact[exact.isfinite()].sort().values
    mids = (exact[1:] + exact[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(512, generator=gen) * s for s in (1e-3, 0.1, 10, 300)])
    extra = torch.tensor([449.0, 500.0, -1e4, 464.0, -0.0, 0.0, 2.0**-10, -(2.0**-9) * 1.5])
    return torch.cat([exact, mids, spread, extra])


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=str)
def test_store_quantizes_bit_exactly(cache_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    vals = _hard_values()
    n = vals.numel() // 64
    x = vals[: n * 64].view(n, 1, 64).to(src_dtype).to(DEVICE)
    k_cache = torch.zeros(-(-n // 8) + 1, 8, 1, 64, dtype=torch.uint8, device=DEVICE)
    k_cache = k_cache.view(cache_dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(k_cache.shape[0] * 8)[:n].to(DEVICE)
    store_kv(x, -x, k_cache, v_cache, slots, k_scale=0.5, v_scale=3.0)
    reference_store_kv(x, -x, k_ref, v_ref, slots, k_scale=0.5, v_scale=3.0)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    # saturation instead of NaN; ties to even, e.g. 1.0625 (between 1 and 1.125) -> 1
    assert dequantize_fp8(quantize_fp8(torch.tensor([1e4, 1.0625]), 1.0), 1.0).tolist() == [
        448.0,
        1.0,
    ]


def _fp8_batch(dtype: torch.dtype, heads: tuple[int, int], **kw: object):
    b = make_paged_batch(
        [40, 21, 9],
        [1, 5, 2],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        block_size=8,
        dtype=dtype,
        device=DEVICE,
        seed=3,
        **kw,  # type: ignore[arg-type]
    )
    k_scale, v_scale = 0.02, 0.01  # unit-variance K/V span about +-4/0.01 = +-400 of +-448
    k8 = torch.zeros(b.k_cache.shape, dtype=torch.uint8, device=DEVICE)
    v8 = torch.zeros_like(k8)
    for s in range(len(b.keys)):
        slots = b.slot_mapping(s)
        store_kv(b.keys[s], b.values[s], k8, v8, slots, k_scale=k_scale, v_scale=v_scale)
    return b, k8, v8, k_scale, v_scale


@pytest.mark.parametrize(
    ("dtype", "heads", "kw"),
    [
        (torch.float32, (4, 2), {}),
        (torch.float16, (8, 2), {"num_splits": 2}),
        (torch.float32, (4, 1), {"shared_prefix": "auto"}),
    ],
    ids=["fp32", "fp16-split", "fp32-cascade"],
)
def test_attention_over_fp8_cache(dtype: torch.dtype, heads: tuple[int, int], kw: dict) -> None:
    b, k8, v8, ks, vs = _fp8_batch(dtype, heads, shared_prefix_blocks=1)
    args = (b.block_tables, b.seq_lens, b.query_start_loc)
    scales = {"k_scale": ks, "v_scale": vs}
    out = paged_attention(b.q, k8, v8, *args, **scales, **kw)
    # Same numbers: the reference over the dequantized cache.
    deq = paged_attention(b.q, k8, v8, *args, **scales, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), deq.float(), atol=tol, rtol=tol)
    # Against the unquantized truth: the documented fp8 error.
    err = (out.float() - contiguous_attention(b).float()).abs()
    assert err.max() < 0.25 and err.mean() < 0.02, (err.max(), err.mean())


def test_paged_kv_cache_fp8_round_trip_and_kernels() -> None:
    kv = PagedKVCache(2, 6, 8, 2, 64, dtype=torch.float16, kv_dtype="fp8", k_scale=0.05)
    assert kv.k[0].dtype == torch.uint8 and kv.fp8 and kv.v_scale == [1.0, 1.0]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(11, 2, 64, generator=gen).half()
    v = torch.randn(11, 2, 64, generator=gen).half()
    slots = torch.arange(3, 14)
    kv.write(1, k, v, slots)
    gk, gv = kv.gather(1, [0, 1], 14)
    assert gk.dtype == torch.float16
    torch.testing.assert_close(gk[3:].float(), k.float(), atol=0.05 * 16, rtol=2**-4)
    torch.testing.assert_close(gv[3:].float(), v.float(), atol=2**-9, rtol=2**-4)
    # store_kv into the same cache writes the same bytes as PagedKVCache.write
    k_bytes = kv.k[1].clone()
    store_kv(k, v, kv.k[1], kv.v[1], slots, k_scale=kv.k_scale[1], v_scale=kv.v_scale[1])
    assert torch.equal(kv.k[1], k_bytes)


def test_fp8_nan_fill_and_bad_arguments() -> None:
    kv = PagedKVCache(1, 2, 8, 1, 64, kv_dtype="fp8", fill=float("nan"))
    assert dequantize_fp8(kv.k[0], 1.0).isnan().all()
    cache = torch.zeros(2, 8, 1, 64, dtype=torch.uint8)
    with pytest.raises(KernelInputError, match="k_scale"):
        store_kv(
            torch.zeros(1, 1, 64),
            torch.zeros(1, 1, 64),
            cache,
            cache,
            torch.tensor([0]),
            k_scale=0.0,
        )
    with pytest.raises(KernelDTypeError):
        store_kv(
            torch.zeros(1, 1, 64, dtype=torch.int32),
            torch.zeros(1, 1, 64),
            cache,
            cache,
            torch.tensor([0]),
        )


def test_store_divides_by_the_scale_as_the_reference_does() -> None:
    """x / scale, not x * (1 / scale): the reciprocal can land one ulp below a tie and round the
    other way (here 4.75 against 4.7499995, e4m3 bytes 74 against 73)."""
    scale = 3.0805263996124266
    x = torch.full((1, 1, 64), 14.6325, device=DEVICE)
    cache = torch.zeros(2, 8, 1, 64, dtype=torch.uint8, device=DEVICE)
    ref = cache.clone()
    slots = torch.tensor([3], device=DEVICE)
    store_kv(x, x, cache, cache.clone(), slots, k_scale=scale, v_scale=scale)
    reference_store_kv(x, x, ref, ref.clone(), slots, k_scale=scale, v_scale=scale)
    assert cache.view(-1)[3 * 64] == ref.view(-1)[3 * 64] == 74
    assert torch.equal(cache, ref)
