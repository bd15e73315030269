"""Triton kernel writing new K/V into the paged cache through a slot mapping (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,  # [num_tokens, Hkv, D]
    v_ptr,  # [num_tokens, Hkv, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [num_tokens] int32/int64, slot = block * BLOCK_SIZE + offset, -1 = skip
    num_tokens,
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
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)
