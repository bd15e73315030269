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
def _attend_tiles(
    acc,  # [BLOCK_M, D] fp32 running numerator
    m_i,  # [BLOCK_M] fp32 running max (log2 units)
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    q,  # [BLOCK_M, D]
    tile_lo,  # scalar: first key tile
    tile_hi,  # scalar: one past the last key tile
    kv_start,  # scalar: first key this program reads
    kv_end,  # scalar: one past the last key this program reads
    q_abs,  # [BLOCK_M] absolute position of each row's query (CAUSAL)
    bt_row,  # [max_blocks] int32 this sequence's block table
    k_head,  # [num_blocks, BLOCK_SIZE, D] this KV head's keys
    v_head,  # [num_blocks, BLOCK_SIZE, D] this KV head's values
    qk_scale,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of every tile is valid and seen by every row
):
    """Online softmax over key tiles ``tile_lo .. tile_hi - 1``; returns (acc, m_i, l_i)."""
    dims = tl.arange(0, HEAD_DIM)  # [D]
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] absolute key positions
        if MASKED:
            # [TILE_N]; entries past the last used block (or before kv_start) are never read
            key_valid = (keys < kv_end) & (keys >= kv_start)
            blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_valid, other=0)  # [TILE_N]
        else:
            blk = tl.load(bt_row + keys // BLOCK_SIZE)  # [TILE_N]
        blk = blk.to(tl.int64)
        slot = (keys % BLOCK_SIZE).to(tl.int64)  # [TILE_N] offset inside the block
        k_offs = (blk * stride_kb + slot * stride_ks)[None, :] + dims[:, None]  # [D, TILE_N]
        v_offs = (blk * stride_vb + slot * stride_vs)[:, None] + dims[None, :]  # [TILE_N, D]
        if MASKED:
            k = tl.load(k_head + k_offs, mask=key_valid[None, :], other=0.0)  # [D, TILE_N]
            v = tl.load(v_head + v_offs, mask=key_valid[:, None], other=0.0)  # [TILE_N, D]
        else:
            k = tl.load(k_head + k_offs)  # [D, TILE_N]
            v = tl.load(v_head + v_offs)  # [TILE_N, D]
        if KV_FP8:
            # e4m3 bytes -> q dtype; k_scale is folded into qk_scale, v_scale applied at the end.
            k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)  # [D, TILE_N]
            v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)  # [TILE_N, D]

        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if MASKED:
            allowed = key_valid[None, :]  # [1, TILE_N]
            if CAUSAL:
                allowed = allowed & (keys[None, :] <= q_abs[:, None])  # [BLOCK_M, TILE_N]
            qk = tl.where(allowed, qk, float("-inf"))  # [BLOCK_M, TILE_N]
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
            # Rows with no allowed key yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M], finite: every key is allowed
            m_shift = m_new
        p = tl.exp2(qk - m_shift[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M] rescale of the previous tiles
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [total_q, Hq, D] q dtype or fp32 (unused with SPLIT)
    lse_ptr,  # [total_q, Hq] fp32 natural-log sum-exp, contiguous (RETURN_LSE without SPLIT)
    seg_out_ptr,  # [total_q, Hq, NUM_SPLITS, D] fp32, contiguous (SPLIT only)
    seg_lse_ptr,  # [total_q, Hq, NUM_SPLITS] fp32 log2-sum-exp2, contiguous (SPLIT only)
    q_ptr,  # [total_q, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D] q dtype, or uint8 e4m3 bits with KV_FP8
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D] q dtype, or uint8 e4m3 bits with KV_FP8
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, context incl. the new tokens
    query_start_loc_ptr,  # [B + 1] int32
    kv_start_ptr,  # [B] int32 first key each sequence reads (HAS_KV_START only)
    num_seqs,
    num_q_heads,
    qk_scale,  # softmax scale * log2(e) (* k_scale with KV_FP8)
    v_scale,  # V dequantization scale (KV_FP8 only)
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
    CAUSAL: tl.constexpr,  # False: every query sees all seq_len keys (shared-prefix pass)
    HAS_KV_START: tl.constexpr,  # skip keys below kv_start[seq] (suffix pass)
    RETURN_LSE: tl.constexpr,  # write the row log-sum-exp (natural log) to lse_ptr
    KV_FP8: tl.constexpr,  # cache holds e4m3 bytes; dequantize on load
    DOT_PRECISION: tl.constexpr,
    UNMASKED_TILES: tl.constexpr,  # tiles that need no mask run a loop without masks
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
    context_len = seq_len - q_len  # scalar: cached prefix length (causal only)

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_pos = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] index among the new tokens
    head = (kv_head * GROUP + rows % GROUP).to(tl.int64)  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < q_len)  # [BLOCK_M]
    q_tok = (q_start + q_pos).to(tl.int64)  # [BLOCK_M] packed token index
    q_abs = context_len + q_pos  # [BLOCK_M] absolute position of the query
    dims = tl.arange(0, HEAD_DIM)  # [D]

    q_offs = q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]  # [BLOCK_M, D]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]

    if CAUSAL:
        # Keys this program needs: causal bound of its last query (never past seq_len).
        kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # scalar
    else:
        kv_end = seq_len  # scalar
    if HAS_KV_START:
        kv_start = tl.load(kv_start_ptr + seq)  # scalar: keys below were read by another pass
    else:
        kv_start = 0
    tile_first = kv_start // TILE_N  # scalar
    tile_end = tl.cdiv(kv_end, TILE_N)  # scalar
    if SPLIT:
        tiles_per_split = tl.cdiv(tile_end - tile_first, NUM_SPLITS)
        tile_lo = tile_first + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_end)
    else:
        tile_lo = tile_first
        tile_hi = tile_end

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt  # [max_blocks] this sequence's table
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh  # [num_blocks, BLOCK_SIZE, D] view
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh  # [num_blocks, BLOCK_SIZE, D] view
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BLOCK_M] running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M] running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # [BLOCK_M, D]

    if UNMASKED_TILES:
        # Tiles whose keys every row of the program sees (past kv_start, below kv_end and, when
        # causal, at or before the first row's query) run a loop without masks; the partial tile
        # at kv_start and the tiles from the causal diagonal on keep them. Rows past q_len sit
        # later than the first row, so they see those keys too.
        if CAUSAL:
            full_end = tl.minimum(kv_end, context_len + q_block * BLOCK_Q + 1)  # scalar
        else:
            full_end = kv_end  # scalar
        free_lo = tl.minimum(tl.maximum(tile_lo, tl.cdiv(kv_start, TILE_N)), tile_hi)  # scalar
        free_hi = tl.maximum(tl.minimum(tile_hi, full_end // TILE_N), free_lo)  # scalar
    else:
        free_lo = tile_lo
        free_hi = tile_lo
    # [tile_lo, free_lo) masked, [free_lo, free_hi) unmasked, [free_hi, tile_hi) masked
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, tile_lo, free_lo, kv_start, kv_end, q_abs, bt_row, k_head, v_head,
        qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, TILE_N, CAUSAL, KV_FP8, DOT_PRECISION, True,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, free_lo, free_hi, kv_start, kv_end, q_abs, bt_row, k_head, v_head,
        qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, TILE_N, CAUSAL, KV_FP8, DOT_PRECISION, False,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, free_hi, tile_hi, kv_start, kv_end, q_abs, bt_row, k_head, v_head,
        qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, TILE_N, CAUSAL, KV_FP8, DOT_PRECISION, True,
    )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # [BLOCK_M]; l == 0 only for empty splits
    result = acc / l_safe[:, None]  # [BLOCK_M, D]
    if KV_FP8:
        result = result * v_scale
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # [BLOCK_M] log2 units
    if SPLIT:
        seg_row = (q_tok * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        seg_offs = seg_row[:, None] * HEAD_DIM + dims[None, :]  # [BLOCK_M, D]
        tl.store(seg_out_ptr + seg_offs, result, mask=row_valid[:, None])
        tl.store(seg_lse_ptr + seg_row, lse, mask=row_valid)
    else:
        o_offs = q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]  # [M, D]
        tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        if RETURN_LSE:
            lse_row = q_tok * num_q_heads + head  # [BLOCK_M]
            tl.store(lse_ptr + lse_row, lse * 0.6931471805599453, mask=row_valid)


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [total_q, Hq, D] q dtype or fp32
    lse_ptr,  # [total_q, Hq] fp32 natural log, contiguous (RETURN_LSE only)
    seg_out_ptr,  # [total_q, Hq, NUM_SPLITS, D] fp32, contiguous
    seg_lse_ptr,  # [total_q, Hq, NUM_SPLITS] fp32, contiguous
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
    RETURN_LSE: tl.constexpr,
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
    lse_max = tl.max(lse, 1)  # [BLOCK_H]
    weight = tl.exp2(lse - lse_max[:, None])  # [BLOCK_H, S]
    seg_offs = rows[:, :, None] * HEAD_DIM + dims[None, None, :]  # [BLOCK_H, S, D]
    seg = tl.load(seg_out_ptr + seg_offs, mask=head_valid[:, None, None], other=0.0)
    weight_sum = tl.sum(weight, 1)  # [BLOCK_H]
    merged = tl.sum(seg * weight[:, :, None], 1) / weight_sum[:, None]  # [BLOCK_H, D]
    o_offs = tok * stride_ot + heads.to(tl.int64)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, merged.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    if RETURN_LSE:
        merged_lse = (lse_max + tl.log2(weight_sum)) * 0.6931471805599453  # [BLOCK_H] natural log
        tl.store(lse_ptr + tok * num_q_heads + heads, merged_lse, mask=head_valid)


@triton.jit
def merge_prefix_kernel(
    out_ptr,  # [total_q, Hq, D] q dtype
    lse_ptr,  # [total_q, Hq] fp32 merged natural-log sum-exp, contiguous (RETURN_LSE only)
    suffix_out_ptr,  # [total_q, Hq, D] fp32, contiguous: each row over its own keys
    suffix_lse_ptr,  # [total_q, Hq] fp32 natural log, contiguous
    prefix_out_ptr,  # [num_prefix_rows, Hq, D] fp32, contiguous: rows stacked by prefix group
    prefix_lse_ptr,  # [num_prefix_rows, Hq] fp32 natural log, contiguous
    prefix_row_ptr,  # [total_q] int32: row of token t in the prefix pass, -1 without a prefix
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
    RETURN_LSE: tl.constexpr,
):
    """Log-sum-exp merge of two attention states over disjoint keys (prefix and suffix)."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_valid = heads < num_q_heads  # [BLOCK_H]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    prow = tl.load(prefix_row_ptr + tok).to(tl.int64) + tl.zeros([BLOCK_H], tl.int64)  # [BLOCK_H]
    has_prefix = prow >= 0  # [BLOCK_H], uniform

    s_rows = tok * num_q_heads + heads  # [BLOCK_H]
    s_lse = tl.load(suffix_lse_ptr + s_rows, mask=head_valid, other=0.0)  # [BLOCK_H]
    s_out = tl.load(
        suffix_out_ptr + s_rows[:, None] * HEAD_DIM + dims[None, :], mask=head_valid[:, None]
    )  # [BLOCK_H, D]
    p_rows = tl.where(has_prefix, prow, 0) * num_q_heads + heads  # [BLOCK_H]
    p_mask = head_valid & has_prefix  # [BLOCK_H]
    p_lse = tl.load(prefix_lse_ptr + p_rows, mask=p_mask, other=float("-inf"))  # [BLOCK_H]
    p_out = tl.load(
        prefix_out_ptr + p_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=p_mask[:, None],
        other=0.0,
    )  # [BLOCK_H, D]
    # The suffix always holds the query's own key, so s_lse is finite and max(...) is too.
    m = tl.maximum(s_lse, p_lse)  # [BLOCK_H]
    w_s = tl.exp(s_lse - m)  # [BLOCK_H]
    w_p = tl.exp(p_lse - m)  # [BLOCK_H]; 0 without a prefix
    merged = (s_out * w_s[:, None] + p_out * w_p[:, None]) / (w_s + w_p)[:, None]  # [BLOCK_H, D]
    o_offs = tok * stride_ot + heads.to(tl.int64)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, merged.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    if RETURN_LSE:
        tl.store(lse_ptr + s_rows, m + tl.log(w_s + w_p), mask=head_valid)
