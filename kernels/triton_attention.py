"""Triton paged attention for mixed prefill / extend / decode batches (imports triton).

Queries are packed varlen (``query_start_loc``); keys and values are read from the paged cache
through each sequence's block table. Sequence ``s`` has ``q_len`` new tokens at the end of its
``seq_len`` tokens, whose K/V are already stored; query ``i`` sits at absolute position
``seq_len - q_len + i`` and attends causally (bottom-right aligned) to keys ``0 ..= that position``.

One program handles ``BLOCK_Q`` query tokens of one sequence times the ``GROUP`` query heads that
share one KV head (GQA), packed into ``BLOCK_M`` rows, so each K/V tile is loaded once per group.
Softmax is online (running max / sum, fp32 accumulator, base-2 exponentials). With ``SPLIT`` the
keys of each program are divided across ``NUM_SPLITS`` programs that write partial outputs plus
their log-sum-exp; ``merge_splits_kernel`` combines them (flash-decoding).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global query block ``q_block_idx`` (binary search over sequences).

    Sequence s owns blocks from ``query_start_loc[s] // BLOCK_Q + s`` on, which leaves room for its
    ``cdiv(q_len, BLOCK_Q)`` blocks; so the grid size follows from shapes alone, with no device
    read on the host. With BLOCK_Q == 1 blocks are tokens and the ``+ s`` slack is not needed.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            start = start // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [total_q, Hq, D] q dtype (unused with SPLIT)
    seg_out_ptr,  # [total_q, Hq, NUM_SPLITS, D] fp32, contiguous (SPLIT only)
    seg_lse_ptr,  # [total_q, Hq, NUM_SPLITS] fp32 log2-sum-exp2, contiguous (SPLIT only)
    q_ptr,  # [total_q, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, context incl. the new tokens
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    num_q_heads,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * GROUP
    TILE_N: tl.constexpr,  # keys per loop iteration
    NUM_SPLITS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)  # scalar sequence index
    q_start = tl.load(query_start_loc_ptr + seq)  # scalar: first packed row of the sequence
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start  # scalar: new tokens
    first_block = q_start // BLOCK_Q + seq if BLOCK_Q > 1 else q_start  # mirrors _find_seq
    q_block = q_block_idx - first_block  # scalar: query block within the sequence
    if q_block * BLOCK_Q >= q_len:
        return  # slack block of the grid
    seq_len = tl.load(seq_lens_ptr + seq)  # scalar: cached + new tokens
    context_len = seq_len - q_len  # scalar: cached prefix length

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_pos = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] index among the new tokens
    head = (kv_head * GROUP + rows % GROUP).to(tl.int64)  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < q_len)  # [BLOCK_M]
    q_tok = (q_start + q_pos).to(tl.int64)  # [BLOCK_M] packed token index
    q_abs = context_len + q_pos  # [BLOCK_M] absolute position of the query
    dims = tl.arange(0, HEAD_DIM)  # [D]

    q_offs = q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]  # [BLOCK_M, D]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]

    # Keys this program needs: causal bound of its last query (never past seq_len).
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # scalar
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt  # [max_blocks] this sequence's table
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh  # [num_blocks, BLOCK_SIZE, D] view
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh  # [num_blocks, BLOCK_SIZE, D] view
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BLOCK_M] running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M] running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # [BLOCK_M, D]

    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] absolute key positions
        key_valid = keys < kv_end  # [TILE_N]; entries past the last used block are never read
        blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)  # [TILE_N]
        slot = (keys % BLOCK_SIZE).to(tl.int64)  # [TILE_N] offset inside the block
        k_offs = (blk * stride_kb + slot * stride_ks)[None, :] + dims[:, None]  # [D, TILE_N]
        k = tl.load(k_head + k_offs, mask=key_valid[None, :], other=0.0)  # [D, TILE_N]
        v_offs = (blk * stride_vb + slot * stride_vs)[:, None] + dims[None, :]  # [TILE_N, D]
        v = tl.load(v_head + v_offs, mask=key_valid[:, None], other=0.0)  # [TILE_N, D]

        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        allowed = key_valid[None, :] & (keys[None, :] <= q_abs[:, None])  # [BLOCK_M, TILE_N]
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
        # Rows with no allowed key yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
        p = tl.exp2(qk - m_shift[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M] rescale of the previous tiles
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # [BLOCK_M]; l == 0 only for empty splits
    result = acc / l_safe[:, None]  # [BLOCK_M, D]
    if SPLIT:
        seg_row = (q_tok * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        seg_offs = seg_row[:, None] * HEAD_DIM + dims[None, :]  # [BLOCK_M, D]
        tl.store(seg_out_ptr + seg_offs, result, mask=row_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # [BLOCK_M]
        tl.store(seg_lse_ptr + seg_row, lse, mask=row_valid)
    else:
        o_offs = q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]  # [M, D]
        tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [total_q, Hq, D] q dtype
    seg_out_ptr,  # [total_q, Hq, NUM_SPLITS, D] fp32, contiguous
    seg_lse_ptr,  # [total_q, Hq, NUM_SPLITS] fp32, contiguous
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
):
    """out = sum_s 2^(lse_s - lse_max) * o_s / sum_s 2^(lse_s - lse_max) for BLOCK_H heads."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_valid = heads < num_q_heads  # [BLOCK_H]
    splits = tl.arange(0, NUM_SPLITS)  # [S]
    dims = tl.arange(0, HEAD_DIM)  # [D]

    rows = (tok * num_q_heads + heads)[:, None] * NUM_SPLITS + splits[None, :]  # [BLOCK_H, S]
    # -inf marks empty splits; every valid query sees key 0, so some split is finite.
    lse = tl.load(seg_lse_ptr + rows, mask=head_valid[:, None], other=0.0)  # [BLOCK_H, S]
    weight = tl.exp2(lse - tl.max(lse, 1)[:, None])  # [BLOCK_H, S]
    seg_offs = rows[:, :, None] * HEAD_DIM + dims[None, None, :]  # [BLOCK_H, S, D]
    seg = tl.load(seg_out_ptr + seg_offs, mask=head_valid[:, None, None], other=0.0)
    merged = tl.sum(seg * weight[:, :, None], 1) / tl.sum(weight, 1)[:, None]  # [BLOCK_H, D]
    o_offs = tok * stride_ot + heads.to(tl.int64)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, merged.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
