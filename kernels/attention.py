"""Public paged attention entry point: argument checks and the choice of backend.

``paged_attention`` checks its arguments, picks the torch reference or the Triton kernels
(``attention_launch`` holds the launches) and, for shared prefixes, the cascade plan. The launch
path reads only tensor metadata: with ``out=``, ``workspace=`` and ``validate=False`` a call
allocates nothing and never synchronizes with the GPU, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Literal

import torch

from prefixcache.errors import (
    KernelDTypeError,
    KernelInputError,
    UnsupportedConfigError,
)
from prefixcache.kernels.attention_launch import (
    choose_launch_config,
    device_capability,
    launch_attention,
    launch_cascade,
)
from prefixcache.kernels.backend import Backend, resolve_backend
from prefixcache.kernels.batch import PagedBatch
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
)
from prefixcache.kernels.reference import reference_paged_attention
from prefixcache.kernels.validation import (
    AttentionShapes,
    check_attention_args,
    check_attention_values,
    check_fp8_scales,
    check_workspace,
    is_fp8,
)

_LOG2E = 1.4426950408889634
FP8_MIN_CAPABILITY = (8, 9)

SharedPrefix = Literal["auto"] | Sequence[PrefixGroup] | CascadePlan | None


def check_fp8_device(device: torch.device) -> None:
    """UnsupportedConfigError for an fp8 K/V cache on a CUDA GPU older than sm_89."""
    if device.type == "cuda" and device_capability(device) < FP8_MIN_CAPABILITY:
        raise UnsupportedConfigError(
            "fp8 K/V caches need an sm_89+ GPU (Ada, Hopper) for e4m3 conversions; use "
            "backend='torch' or a 16-bit cache"
        )


def workspace_size(
    total_q: int, num_q_heads: int, head_dim: int, num_splits: int = MAX_SPLITS
) -> int:
    """fp32 elements of the ``workspace=`` buffer for up to ``num_splits`` KV splits.

    Holds the split partial outputs and their log-sum-exps; a buffer sized for MAX_SPLITS fits any
    config the heuristic picks for that many query rows.
    """
    return total_q * num_q_heads * num_splits * (head_dim + 1)


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
    A ``CascadePlan`` from ``plan_shared_prefix`` skips the planning: no host reads, so the call
    can be captured in a CUDA graph (it still allocates its two passes' outputs).

    k_cache / v_cache may be fp8 (uint8 holding e4m3 bits, or float8_e4m3fn): keys and values
    are dequantized on load as ``k_scale * k`` and ``v_scale * v``; q stays fp32/fp16/bf16. The
    scales must be finite and > 0 for every cache (unused but checked for 16/32-bit ones).

    ``validate=False`` skips the checks that read seq_lens and block tables on the host (a GPU
    sync). With ``out=``, ``workspace=`` (a float32 buffer of ``workspace_size`` elements) and
    ``validate=False`` the call allocates nothing and does not sync (CUDA-graph capturable).
    ``backend``: see ``resolve_backend``.
    """
    batch = PagedBatch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    shapes = check_attention_args(batch, out)
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
                f"{lse.dtype} {tuple(lse.shape)} on {lse.device}"
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
        check_workspace(workspace, q.device)
    if validate:
        max_seq_len = check_attention_values(batch, shapes)
    if isinstance(shared_prefix, CascadePlan):
        plan: CascadePlan | None = _check_plan(shared_prefix, shapes, q.device)
    else:
        groups = _resolve_groups(shared_prefix, shapes, block_tables, seq_lens, query_start_loc)
        plan = (
            build_plan(groups, block_tables, query_start_loc, shapes.block_size) if groups else None
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
                batch,
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

    if plan is not None:
        launch_cascade(
            batch,
            plan=plan,
            shapes=shapes,
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            config=config,
            out=out,
            lse=lse,
            qk_scale=qk_scale,
            v_scale=v_scale,
            fp8=fp8,
        )
        return out

    cfg = config or choose_launch_config(
        shapes, q.device, max_seq_len, num_splits, q.element_size()
    )
    launch_attention(
        batch,
        out=out,
        lse=lse,
        shapes=shapes,
        cfg=cfg,
        workspace=workspace,
        qk_scale=qk_scale,
        v_scale=v_scale,
        fp8=fp8,
    )
    return out


def plan_shared_prefix(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    groups: Literal["auto"] | Sequence[PrefixGroup] = "auto",
) -> CascadePlan | None:
    """The shared-prefix plan of a batch (None when no group shares a prefix), for
    ``paged_attention(..., shared_prefix=plan)``.

    ``groups``: ``"auto"`` or explicit ``PrefixGroup``s, found or checked as ``paged_attention``
    does (reading the index tensors on the host). The plan holds the groups' prefix blocks, their
    members' query rows and prefix lengths: it stays valid while the batch keeps the same
    sequences in the same order, each with as many new tokens as when planned and the same first
    ``num_blocks`` blocks, as across the decode steps of one batch, whose every step can then
    replay one CUDA graph.
    """
    shapes = AttentionShapes(
        num_seqs=seq_lens.shape[0],
        total_q=int(query_start_loc[-1]),
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=1,
        block_size=block_size,
        num_blocks=0,
        max_blocks=block_tables.shape[1],
    )
    found = _resolve_groups(groups, shapes, block_tables, seq_lens, query_start_loc)
    return build_plan(found, block_tables, query_start_loc, block_size) if found else None


def _check_plan(plan: CascadePlan, shapes: AttentionShapes, device: torch.device) -> CascadePlan:
    """KernelInputError unless ``plan`` fits this batch's sizes and device (no device reads)."""
    if (
        plan.prefix_row_of.shape != (shapes.total_q,)
        or plan.kv_start.shape != (shapes.num_seqs,)
        or plan.prefix_row_of.device != device
        or plan.max_prefix_len > shapes.max_blocks * shapes.block_size
    ):
        raise KernelInputError(
            f"shared_prefix plan is for another batch: it has {plan.prefix_row_of.shape[0]} query "
            f"rows and {plan.kv_start.shape[0]} sequences on {plan.prefix_row_of.device}, this "
            f"batch {shapes.total_q} and {shapes.num_seqs} on {device}"
        )
    return plan


def _resolve_groups(
    shared_prefix: Literal["auto"] | Sequence[PrefixGroup] | None,
    shapes: AttentionShapes,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
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
            "shared_prefix must be 'auto', None, a CascadePlan or a sequence of "
            f"PrefixGroup(seqs, num_blocks) of ints, got {shared_prefix!r}"
        ) from None
    # checked even with validate=False: the cascade path reads the tables on the host anyway
    # (it is eager only), and a group out of range gives wrong output silently
    check_groups(groups, block_tables, seq_lens, query_start_loc, shapes.block_size)
    return groups
