"""The Triton launches behind ``paged_attention``: the launch config, one attention launch with
its split merge, and the two-pass cascade over shared prefixes.

Everything here reads only tensor metadata: the config choice and the device properties are
cached per shape and device, and without a split (or with a ``workspace``) a launch allocates
nothing. The arguments were checked by ``paged_attention`` before they get here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from prefixcache.errors import KernelInputError
from prefixcache.kernels.backend import check_kernel_mode
from prefixcache.kernels.batch import PagedBatch
from prefixcache.kernels.cascade import CascadePlan
from prefixcache.kernels.config import AttentionConfig, choose_config
from prefixcache.kernels.validation import AttentionShapes, check_workspace


@functools.cache
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 0 elsewhere (never splits)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability (cached); (0, 0) elsewhere."""
    if device.type != "cuda":
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


_cached_config = functools.lru_cache(maxsize=4096)(choose_config)


def choose_launch_config(
    shapes: AttentionShapes,
    device: torch.device,
    max_seq_len: int,
    num_splits: int | None,
    elem_bytes: int = 2,
) -> AttentionConfig:
    """The heuristic's config for this shape on ``device`` (cached per shape and device);
    ``elem_bytes``: the size of a query element."""
    return _cached_config(
        num_seqs=shapes.num_seqs,
        total_q=shapes.total_q,
        num_kv_heads=shapes.num_kv_heads,
        group=shapes.group,
        head_dim=shapes.head_dim,
        max_seq_len=max_seq_len,
        num_sms=device_num_sms(device),
        num_splits=num_splits,
        capability=device_capability(device),
        elem_bytes=elem_bytes,
    )


class SplitBuffers(NamedTuple):
    """Where the KV splits of one launch leave their partial results for the merge."""

    seg_out: torch.Tensor  # [total_q, Hq, S, D] fp32
    seg_lse: torch.Tensor  # [total_q, Hq, S] fp32


def _split_buffers(
    shapes: AttentionShapes, splits: int, workspace: torch.Tensor | None, device: torch.device
) -> SplitBuffers:
    seg_shape = (shapes.total_q, shapes.num_q_heads, splits)
    n_out = math.prod(seg_shape) * shapes.head_dim
    n_lse = math.prod(seg_shape)
    if workspace is None:
        flat = torch.empty(n_out + n_lse, dtype=torch.float32, device=device)
    else:
        check_workspace(workspace, device)
        if workspace.numel() < n_out + n_lse:
            raise KernelInputError(
                f"workspace has {workspace.numel()} elements; {splits} splits need "
                f"{n_out + n_lse} (workspace_size)"
            )
        flat = workspace
    seg_out = flat[:n_out].view(*seg_shape, shapes.head_dim)
    return SplitBuffers(seg_out, flat[n_out : n_out + n_lse].view(seg_shape))


def _block_h(num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """Heads per merge program: bounds the [BLOCK_H, S, D] tile to ~8k fp32 values."""
    block_h = 1 << (num_q_heads - 1).bit_length()
    return max(1, min(block_h, 8192 // (num_splits * head_dim)))


def launch_cascade(
    batch: PagedBatch,
    *,
    plan: CascadePlan,
    shapes: AttentionShapes,
    max_seq_len: int,
    num_splits: int | None,
    config: AttentionConfig | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    qk_scale: float,
    v_scale: float,
    fp8: bool,
) -> None:
    """Prefix pass (group queries stacked, no mask) + own-keys pass, merged by log-sum-exp."""
    from prefixcache.kernels.triton_attention import merge_prefix_kernel

    q = batch.q
    # Own keys: every sequence from its prefix length (0 without a group) to its causal bound.
    suffix_out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [total_q, Hq, D]
    suffix_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [total_q, Hq]
    launch_attention(
        batch,
        out=suffix_out,
        lse=suffix_lse,
        shapes=shapes,
        cfg=config
        or choose_launch_config(shapes, q.device, max_seq_len, num_splits, q.element_size()),
        workspace=None,
        qk_scale=qk_scale,
        v_scale=v_scale,
        fp8=fp8,
        kv_start=plan.kv_start,
    )
    # Shared prefixes: one virtual sequence per group holding all its members' query rows.
    q_prefix = q.index_select(0, plan.prefix_rows.long())  # [num_prefix_rows, Hq, D]
    prefix_shapes = dataclasses.replace(
        shapes,
        num_seqs=plan.num_groups,
        total_q=q_prefix.shape[0],
        max_blocks=plan.prefix_tables.shape[1],
    )
    prefix_out = torch.empty(q_prefix.shape, dtype=torch.float32, device=q.device)  # like q_prefix
    prefix_lse = torch.empty(q_prefix.shape[:2], dtype=torch.float32, device=q.device)  # [rows, Hq]
    prefix_batch = batch._replace(
        q=q_prefix,
        block_tables=plan.prefix_tables,
        seq_lens=plan.prefix_lens,
        query_start_loc=plan.prefix_query_start_loc,
    )
    launch_attention(
        prefix_batch,
        out=prefix_out,
        lse=prefix_lse,
        shapes=prefix_shapes,
        cfg=choose_launch_config(
            prefix_shapes, q.device, plan.max_prefix_len, num_splits, q.element_size()
        ),
        workspace=None,
        qk_scale=qk_scale,
        v_scale=v_scale,
        fp8=fp8,
        causal=False,
    )
    block_h = _block_h(shapes.num_q_heads, shapes.head_dim, 1)
    merge_prefix_kernel[(shapes.total_q, -(-shapes.num_q_heads // block_h))](
        out_ptr=out,
        lse_ptr=suffix_lse if lse is None else lse,
        suffix_out_ptr=suffix_out,
        suffix_lse_ptr=suffix_lse,
        prefix_out_ptr=prefix_out,
        prefix_lse_ptr=prefix_lse,
        prefix_row_ptr=plan.prefix_row_of,
        num_q_heads=shapes.num_q_heads,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        HEAD_DIM=shapes.head_dim,
        BLOCK_H=block_h,
        RETURN_LSE=lse is not None,
        num_warps=4,
    )


def launch_attention(
    batch: PagedBatch,
    *,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    shapes: AttentionShapes,
    cfg: AttentionConfig,
    workspace: torch.Tensor | None,
    qk_scale: float,
    v_scale: float,
    fp8: bool,
    kv_start: torch.Tensor | None = None,
    causal: bool = True,
) -> None:
    """One attention launch (+ the split merge); reads only metadata, allocates only without
    a workspace when splitting."""
    from prefixcache.kernels.triton_attention import merge_splits_kernel, paged_attention_kernel

    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = batch
    check_kernel_mode(paged_attention_kernel, q.device)
    split = cfg.num_splits > 1
    if split:
        buffers = _split_buffers(shapes, cfg.num_splits, workspace, q.device)
        seg_out, seg_lse = buffers.seg_out, buffers.seg_lse
    else:
        seg_out = seg_lse = out  # unused without SPLIT: the kernel never touches them
    if fp8:  # e4m3 bits as bytes: the kernel bitcasts them (views, no copy)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    grid = (cfg.num_q_blocks(shapes.total_q, shapes.num_seqs), shapes.num_kv_heads, cfg.num_splits)
    paged_attention_kernel[grid](
        out_ptr=out,
        lse_ptr=out if lse is None else lse,
        seg_out_ptr=seg_out,
        seg_lse_ptr=seg_lse,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        kv_start_ptr=seq_lens if kv_start is None else kv_start,
        num_seqs=shapes.num_seqs,
        num_q_heads=shapes.num_q_heads,
        qk_scale=qk_scale,
        v_scale=v_scale,
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
        CAUSAL=causal,
        HAS_KV_START=kv_start is not None,
        RETURN_LSE=lse is not None,
        KV_FP8=fp8,
        # fp32 callers expect fp32 products, not TF32; ignored for fp16/bf16.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UNMASKED_TILES=cfg.unmasked_tiles,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        block_h = _block_h(shapes.num_q_heads, shapes.head_dim, cfg.num_splits)
        merge_grid = (shapes.total_q, -(-shapes.num_q_heads // block_h))
        merge_splits_kernel[merge_grid](
            out_ptr=out,
            lse_ptr=seg_lse if lse is None else lse,
            seg_out_ptr=seg_out,
            seg_lse_ptr=seg_lse,
            num_q_heads=shapes.num_q_heads,
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            HEAD_DIM=shapes.head_dim,
            NUM_SPLITS=cfg.num_splits,
            BLOCK_H=block_h,
            RETURN_LSE=lse is not None,
            num_warps=4,
        )
