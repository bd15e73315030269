"""Triton kernel writing new K/V into the paged cache through a slot mapping (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _to_e4m3_bytes(x, scale):
    """x / scale saturated to +-448 and rounded to nearest even e4m3, as its bits in uint8.

    The division is IEEE round-to-nearest (``div_rn``), as the reference's: a reciprocal multiply
    can land one ulp off and flip an e4m3 tie.

    Integer rounding rather than a float8 cast: exact in the interpreter too, and store_kv is
    bandwidth bound, so the few extra integer ops cost nothing.
    """
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)  # same shape, fp32
    sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7  # 0x80 for negatives (and -0.0)
    a = tl.abs(y)
    a_bits = a.to(tl.uint32, bitcast=True)
    # Round the fp32 mantissa to 3 bits, ties to even; a carry bumps the exponent as it should.
    r = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # exponent rebiased 127 -> 7
    # Below 2**-6: subnormal steps of 2**-9; adding 2**23 rounds to an integer, ties to even.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal) | sign
    xf = x.to(tl.float32)
    return tl.where(xf != xf, 0x7F, code).to(tl.uint8)  # NaN stays NaN (0x7f), as torch casts it


@triton.jit
def store_kv_kernel(
    k_ptr,  # [num_tokens, Hkv, D]
    v_ptr,  # [num_tokens, Hkv, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D] k dtype, or uint8 e4m3 bits with QUANT_FP8
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D] v dtype, or uint8 e4m3 bits with QUANT_FP8
    slot_mapping_ptr,  # [num_tokens] int32/int64, slot = block * BLOCK_SIZE + offset, -1 = skip
    num_tokens,
    k_scale,  # fp32 (QUANT_FP8 only)
    v_scale,  # fp32 (QUANT_FP8 only)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    QUANT_FP8: tl.constexpr,  # store x / scale as saturated, round-to-nearest-even e4m3 bytes
):
    """One program copies BLOCK_T tokens of one KV head."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    head = tl.program_id(1).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + toks, mask=toks < num_tokens, other=-1)  # [BLOCK_T]
    slots = slots.to(tl.int64)
    write = slots >= 0  # [BLOCK_T]; padding tokens carry slot -1
    blk = tl.where(write, slots, 0) // BLOCK_SIZE  # [BLOCK_T]
    off = tl.where(write, slots, 0) % BLOCK_SIZE  # [BLOCK_T]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    mask = write[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_T, D_PAD]
    tok64 = toks.to(tl.int64)

    k_src = tok64[:, None] * stride_kt + head * stride_kh + dims[None, :]  # [BLOCK_T, D_PAD]
    v_src = tok64[:, None] * stride_vt + head * stride_vh + dims[None, :]  # [BLOCK_T, D_PAD]
    k_dst = (blk * stride_kcb + off * stride_kcs + head * stride_kch)[:, None] + dims[None, :]
    v_dst = (blk * stride_vcb + off * stride_vcs + head * stride_vch)[:, None] + dims[None, :]
    k = tl.load(k_ptr + k_src, mask=mask)  # [BLOCK_T, D_PAD]
    v = tl.load(v_ptr + v_src, mask=mask)  # [BLOCK_T, D_PAD]
    if QUANT_FP8:
        k = _to_e4m3_bytes(k, k_scale)  # [BLOCK_T, D_PAD] uint8
        v = _to_e4m3_bytes(v, v_scale)  # [BLOCK_T, D_PAD] uint8
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)
