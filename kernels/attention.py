"""Public paged attention entry point: validation, backend dispatch and the Triton launch."""

from __future__ import annotations

import math

import torch

from prefixcache.kernels.backend import Backend, check_kernel_mode, resolve_backend
from prefixcache.kernels.config import AttentionConfig, choose_config
from prefixcache.kernels.reference import reference_paged_attention
from prefixcache.kernels.validation import (
    AttentionShapes,
    check_attention_args,
    check_attention_values,
)

_LOG2E = 1.4426950408889634


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    backend: Backend = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of packed new queries over their sequences' paged K/V.

    q: [total_q, Hq, D] new query tokens of all sequences, packed; sequence b owns rows
    ``query_start_loc[b]:query_start_loc[b+1]`` (>= 1 row; decode = 1). k_cache / v_cache:
    [num_blocks, block_size, Hkv, D], already holding the new tokens' K/V (see ``store_kv``).
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 = cached + new tokens;
    query_start_loc: [B + 1] int32. Query i of sequence b attends to keys
    ``0 ..= seq_lens[b] - q_len + i`` (bottom-right aligned causal). Returns [total_q, Hq, D].

    scale defaults to 1/sqrt(D). ``max_seq_len`` feeds the split-KV heuristic (read from
    seq_lens when omitted); ``num_splits`` forces the split count and ``config`` the whole launch
    config. ``validate=False`` skips the value checks that read seq_lens and block tables on the
    host (a GPU sync). ``backend``: see ``resolve_backend``.
    """
    shapes = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if validate:
        max_seq_len = check_attention_values(shapes, block_tables, seq_lens, query_start_loc)
    if config is not None and num_splits is not None:
        raise ValueError("pass either num_splits or config (which has num_splits), not both")
    if config is not None:
        config.validate(shapes.group)  # on every backend, so a bad config never passes silently
    scale = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    out = torch.empty_like(q) if out is None else out
    if shapes.total_q == 0:
        return out

    if resolve_backend(backend, q.device) == "torch":
        out.copy_(
            reference_paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale
            )
        )
        return out

    if config is None:
        on_cuda = q.device.type == "cuda"
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if on_cuda else 0
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        config = choose_config(
            num_seqs=shapes.num_seqs,
            total_q=shapes.total_q,
            num_kv_heads=shapes.num_kv_heads,
            group=shapes.group,
            head_dim=shapes.head_dim,
            max_seq_len=max_seq_len,
            num_sms=num_sms,
            num_splits=num_splits,
        )
        config.validate(shapes.group)
    _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out=out,
        scale=scale,
        shapes=shapes,
        cfg=config,
    )
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    out: torch.Tensor,
    scale: float,
    shapes: AttentionShapes,
    cfg: AttentionConfig,
) -> None:
    from prefixcache.kernels.triton_attention import merge_splits_kernel, paged_attention_kernel

    check_kernel_mode(paged_attention_kernel, q.device)
    split = cfg.num_splits > 1
    if split:
        seg_out = torch.empty(
            (shapes.total_q, shapes.num_q_heads, cfg.num_splits, shapes.head_dim),
            dtype=torch.float32,
            device=q.device,
        )
        seg_lse = torch.empty(seg_out.shape[:-1], dtype=torch.float32, device=q.device)
    else:
        seg_out = seg_lse = out  # unused without SPLIT: the kernel never touches them
    grid = (cfg.num_q_blocks(shapes.total_q, shapes.num_seqs), shapes.num_kv_heads, cfg.num_splits)
    paged_attention_kernel[grid](
        out_ptr=out,
        seg_out_ptr=seg_out,
        seg_lse_ptr=seg_lse,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        num_seqs=shapes.num_seqs,
        num_q_heads=shapes.num_q_heads,
        qk_scale=scale * _LOG2E,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_kb=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bt=block_tables.stride(0),
        HEAD_DIM=shapes.head_dim,
        BLOCK_SIZE=shapes.block_size,
        GROUP=shapes.group,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits,
        SPLIT=split,
        # fp32 callers expect fp32 products, not TF32; ignored for fp16/bf16.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        # Bound the [BLOCK_H, S, D] merge tile to ~8k fp32 values (registers on a GPU).
        block_h = 1 << (shapes.num_q_heads - 1).bit_length()
        block_h = max(1, min(block_h, 8192 // (cfg.num_splits * shapes.head_dim)))
        merge_grid = (shapes.total_q, -(-shapes.num_q_heads // block_h))
        merge_splits_kernel[merge_grid](
            out_ptr=out,
            seg_out_ptr=seg_out,
            seg_lse_ptr=seg_lse,
            num_q_heads=shapes.num_q_heads,
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            HEAD_DIM=shapes.head_dim,
            NUM_SPLITS=cfg.num_splits,
            BLOCK_H=block_h,
            num_warps=4,
        )
