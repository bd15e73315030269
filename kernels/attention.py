"""Public paged attention entry point: validation, backend dispatch and the Triton launches.

The launch path reads only tensor metadata: the config choice and the device properties are cached
per shape and device, and with ``out=``, ``workspace=`` and ``validate=False`` a call allocates
nothing and never synchronizes with the GPU, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from prefixcache.kernels.backend import Backend, check_kernel_mode, resolve_backend
from prefixcache.kernels.cascade import (
    CascadePlan,
    PrefixGroup,
    build_plan,
    check_groups,
    find_prefix_groups,
)
from prefixcache.kernels.config import (
    MAX_SPLITS,
    AttentionConfig,
    check_num_splits,
    choose_config,
)
from prefixcache.kernels.kernel_errors import (
    KernelDTypeError,
    KernelInputError,
    UnsupportedConfigError,
)
from prefixcache.kernels.reference import reference_paged_attention
from prefixcache.kernels.validation import (
    AttentionShapes,
    check_attention_args,
    check_attention_values,
    check_fp8_scales,
    is_fp8,
)

_LOG2E = 1.4426950408889634
FP8_MIN_CAPABILITY = (8, 9)

SharedPrefix = Literal["auto"] | Sequence[PrefixGroup] | None


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


def check_fp8_device(device: torch.device) -> None:
    """UnsupportedConfigError for an fp8 K/V cache on a CUDA GPU older than sm_89."""
    if device.type == "cuda" and device_capability(device) < FP8_MIN_CAPABILITY:
        raise UnsupportedConfigError(
            "fp8 K/V caches need an sm_89+ GPU (Ada, Hopper) for e4m3 conversions; use "
            "backend='torch' or a 16-bit cache"
        )


_cached_config = functools.lru_cache(maxsize=4096)(choose_config)


def workspace_size(
    total_q: int, num_q_heads: int, head_dim: int, num_splits: int = MAX_SPLITS
) -> int:
    """fp32 elements of the ``workspace=`` buffer for up to ``num_splits`` KV splits.

    Holds the split partial outputs and their log-sum-exps; a buffer sized for MAX_SPLITS fits any
    config the heuristic picks for that many query rows.
    """
    return total_q * num_q_heads * num_splits * (head_dim + 1)


def _check_workspace(workspace: torch.Tensor, device: torch.device) -> None:
    """A ``workspace=`` buffer's type, dtype, rank, device and layout are checked whether or not
    this call splits, so a wrong kind of buffer fails at once; its size is checked when a call
    splits (the size it needs depends on the shape: ``workspace_size``)."""
    if (
        not isinstance(workspace, torch.Tensor)
        or workspace.dtype != torch.float32
        or workspace.dim() != 1
        or workspace.device != device
        or not workspace.is_contiguous()
    ):
        got = (
            f"{workspace.dtype} {tuple(workspace.shape)} on {workspace.device}"
            if isinstance(workspace, torch.Tensor)
            else type(workspace).__name__
        )
        raise KernelInputError(
            "workspace must be a contiguous 1-D float32 tensor on the device of q "
            f"(see workspace_size), got {got}"
        )


class SplitBuffers(NamedTuple):
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
        _check_workspace(workspace, device)
        if workspace.numel() < n_out + n_lse:
            raise KernelInputError(
                f"workspace has {workspace.numel()} elements; {splits} splits need "
                f"{n_out + n_lse} (workspace_size)"
            )
        flat = workspace
    seg_out = flat[:n_out].view(*seg_shape, shapes.head_dim)
    return SplitBuffers(seg_out, flat[n_out : n_out + n_lse].view(seg_shape))


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
    lse: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    shared_prefix: SharedPrefix = None,
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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

    scale defaults to 1/sqrt(D). ``lse``: optional [total_q, Hq] float32 output filled with each
    row's log-sum-exp of the scaled scores (natural log). ``max_seq_len`` feeds the split-KV
    heuristic (read from seq_lens when validating, else bounded by the table width);
    ``num_splits`` forces the split count and ``config`` the whole launch config.

    ``shared_prefix``: ``"auto"`` groups sequences whose tables start with the same blocks
    (``prefixcache.kernels.cascade``) and reads each shared prefix once for the whole group;
    explicit ``PrefixGroup``s are also accepted; None (default) reads every sequence's keys on
    its own. Planning reads the index tensors on the host, so this path is eager only, and
    explicit groups are checked (in range, disjoint, really shared) even with ``validate=False``.

    k_cache / v_cache may be fp8 (uint8 holding e4m3 bits, or float8_e4m3fn): keys and values
    are dequantized on load as ``k_scale * k`` and ``v_scale * v``; q stays fp32/fp16/bf16. The
    scales must be finite and > 0 for every cache (unused but checked for 16/32-bit ones).

    ``validate=False`` skips the checks that read seq_lens and block tables on the host (a GPU
    sync). With ``out=``, ``workspace=`` (a float32 buffer of ``workspace_size`` elements) and
    ``validate=False`` the call allocates nothing and does not sync (CUDA-graph capturable).
    ``backend``: see ``resolve_backend``.
    """
    shapes = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    fp8 = is_fp8(k_cache)
    if lse is not None and (
        not isinstance(lse, torch.Tensor)
        or lse.shape != (shapes.total_q, shapes.num_q_heads)
        or lse.dtype != torch.float32
        or lse.device != q.device
        or not lse.is_contiguous()
    ):
        raise KernelInputError(
            f"lse must be a contiguous float32 [total_q, num_q_heads] = "
            f"{(shapes.total_q, shapes.num_q_heads)} tensor on {q.device}, got "
            + (
                f"{lse.dtype} {tuple(lse.shape)}"
                if isinstance(lse, torch.Tensor)
                else type(lse).__name__
            )
        )
    if config is not None and num_splits is not None:
        raise KernelInputError("pass either num_splits or config (which has num_splits), not both")
    if config is not None:
        if not isinstance(config, AttentionConfig):
            raise KernelInputError(f"config must be an AttentionConfig, got {config!r}")
        config.validate(shapes.group)  # on every backend, so a bad config never passes silently
    if num_splits is not None:
        check_num_splits(num_splits)
    # checked for every cache (a bad scale is a caller's mistake even where it is unused)
    k_scale, v_scale = check_fp8_scales(k_scale, v_scale)
    if workspace is not None:
        _check_workspace(workspace, q.device)
    if validate:
        max_seq_len = check_attention_values(shapes, block_tables, seq_lens, query_start_loc)
    groups = _resolve_groups(
        shared_prefix, shapes, block_tables, seq_lens, query_start_loc, validate=validate
    )
    scale = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    out = torch.empty_like(q) if out is None else out
    use = resolve_backend(backend, q.device)  # a backend that cannot run is refused, batch or not
    if use == "triton" and q.device.type != "cuda" and q.dtype == torch.bfloat16:
        # the Triton interpreter computes a bf16 tl.dot wrongly: never return its garbage
        if backend != "auto":
            raise KernelDTypeError(
                "bf16 attention needs a GPU: the Triton interpreter computes bf16 dot products "
                "wrongly on CPU tensors; use fp16/fp32 there, or backend='torch' (or 'auto')"
            )
        use = "torch"
    if shapes.total_q == 0:
        return out

    if use == "torch":
        out.copy_(
            reference_paged_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale=scale,
                lse_out=lse,
                k_scale=k_scale if fp8 else None,
                v_scale=v_scale if fp8 else None,
            )
        )
        return out

    if fp8:
        check_fp8_device(q.device)
    if max_seq_len is None:
        max_seq_len = shapes.max_blocks * shapes.block_size  # a bound read from shapes: no sync
    qk_scale = scale * _LOG2E * (k_scale if fp8 else 1.0)
    common = {"qk_scale": qk_scale, "v_scale": v_scale, "fp8": fp8}

    if groups:
        _cascade(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            plan=build_plan(groups, block_tables, query_start_loc, shapes.block_size),
            shapes=shapes,
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            config=config,
            out=out,
            lse=lse,
            **common,
        )
        return out

    cfg = config or _choose(shapes, q.device, max_seq_len, num_splits)
    _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out=out,
        lse=lse,
        shapes=shapes,
        cfg=cfg,
        workspace=workspace,
        **common,
    )
    return out


def _resolve_groups(
    shared_prefix: SharedPrefix,
    shapes: AttentionShapes,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    validate: bool,
) -> list[PrefixGroup]:
    if shared_prefix is None:
        return []
    if isinstance(shared_prefix, str):
        if shared_prefix != "auto":
            raise KernelInputError(
                f"shared_prefix must be 'auto', None or PrefixGroups, got {shared_prefix!r}"
            )
        return find_prefix_groups(
            block_tables, seq_lens, query_start_loc, block_size=shapes.block_size
        )
    try:
        groups = [
            PrefixGroup(tuple(operator.index(s) for s in g[0]), operator.index(g[1]))
            for g in shared_prefix
        ]
    except (TypeError, ValueError, IndexError):
        raise KernelInputError(
            "shared_prefix must be 'auto', None or a sequence of "
            f"PrefixGroup(seqs, num_blocks) of ints, got {shared_prefix!r}"
        ) from None
    # checked even with validate=False: the cascade path reads the tables on the host anyway
    # (it is eager only), and a group out of range gives wrong output silently
    check_groups(groups, block_tables, seq_lens, query_start_loc, shapes.block_size)
    return groups


def _choose(
    shapes: AttentionShapes, device: torch.device, max_seq_len: int, num_splits: int | None
) -> AttentionConfig:
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
    )


def _cascade(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
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

    f32 = {"dtype": torch.float32, "device": q.device}
    common = {"qk_scale": qk_scale, "v_scale": v_scale, "fp8": fp8, "workspace": None}
    # Own keys: every sequence from its prefix length (0 without a group) to its causal bound.
    suffix_out = torch.empty(q.shape, **f32)
    suffix_lse = torch.empty(q.shape[:2], **f32)
    _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out=suffix_out,
        lse=suffix_lse,
        shapes=shapes,
        cfg=config or _choose(shapes, q.device, max_seq_len, num_splits),
        kv_start=plan.kv_start,
        **common,
    )
    # Shared prefixes: one virtual sequence per group holding all its members' query rows.
    q_prefix = q.index_select(0, plan.prefix_rows.long())  # [num_prefix_rows, Hq, D]
    prefix_shapes = dataclasses.replace(
        shapes,
        num_seqs=plan.num_groups,
        total_q=q_prefix.shape[0],
        max_blocks=plan.prefix_tables.shape[1],
    )
    prefix_out = torch.empty(q_prefix.shape, **f32)
    prefix_lse = torch.empty(q_prefix.shape[:2], **f32)
    _launch(
        q_prefix,
        k_cache,
        v_cache,
        plan.prefix_tables,
        plan.prefix_lens,
        plan.prefix_query_start_loc,
        out=prefix_out,
        lse=prefix_lse,
        shapes=prefix_shapes,
        cfg=_choose(prefix_shapes, q.device, plan.max_prefix_len, num_splits),
        causal=False,
        **common,
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


def _block_h(num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """Heads per merge program: bounds the [BLOCK_H, S, D] tile to ~8k fp32 values."""
    block_h = 1 << (num_q_heads - 1).bit_length()
    return max(1, min(block_h, 8192 // (num_splits * head_dim)))


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
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

    check_kernel_mode(paged_attention_kernel, q.device)
    split = cfg.num_splits > 1
    if split:
        seg_out, seg_lse = _split_buffers(shapes, cfg.num_splits, workspace, q.device)
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
