"""Argument checks shared by the kernel wrappers; each failure raises a typed, actionable error.

Shape/dtype/device checks read metadata only. Value checks (lengths, block ids, slots) read the
small index tensors and therefore synchronize with a GPU; wrappers let callers skip them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prefixcache.errors import (
    KernelDTypeError,
    KernelInputError,
    UnsupportedConfigError,
)
from prefixcache.kernels.batch import PagedBatch

SUPPORTED_HEAD_DIMS = (64, 128)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SLOT_DTYPES = (torch.int32, torch.int64)
# fp8 K/V caches: e4m3 values, or their bits in uint8 (what vLLM allocates for kv_cache_dtype=fp8).
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def is_fp8(cache: torch.Tensor) -> bool:
    """True for an e4m3 K/V cache (float8_e4m3fn, or uint8 holding its bits)."""
    return cache.dtype in FP8_DTYPES


@dataclass(frozen=True)
class AttentionShapes:
    """Sizes of one paged attention call, read from its tensors."""

    num_seqs: int
    total_q: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _tensors(**named: object) -> None:
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise KernelDTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelDTypeError(f"{name} has dtype {x.dtype}; expected one of {names}")


def _rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise KernelInputError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise KernelInputError(f"all tensors must be on one device, got {listing}")


def _last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels step through a tensor's last dimension one element at a time."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise UnsupportedConfigError(
                f"{name} must be contiguous in its last dimension; pass {name}.contiguous()"
            )


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a K/V cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    _tensors(k_cache=k_cache, v_cache=v_cache)
    _rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    _dtype("k_cache", k_cache, FLOAT_DTYPES + FP8_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise KernelDTypeError(f"v_cache is {v_cache.dtype} but k_cache is {k_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_kv_heads < 1:
        raise KernelInputError("the cache has 0 KV heads (k_cache.shape[2])")
    if block_size < 8 or block_size & (block_size - 1):
        raise UnsupportedConfigError(
            f"block_size (k_cache.shape[1]) must be a power of two >= 8, got {block_size}"
        )
    _last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_attention_args(batch: PagedBatch, out: torch.Tensor | None) -> AttentionShapes:
    """Shape, dtype, device and layout checks for ``paged_attention`` (no device reads)."""
    tensors = batch._asdict()
    _tensors(**tensors)
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = batch
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    _rank("q", q, 3, "[total_q, num_q_heads, head_dim]")
    _rank("block_tables", block_tables, 2, "[batch, max_blocks]")
    _rank("seq_lens", seq_lens, 1, "[batch]")
    _rank("query_start_loc", query_start_loc, 1, "[batch + 1]")
    _dtype("q", q, FLOAT_DTYPES)
    if q.dtype != k_cache.dtype and not is_fp8(k_cache):
        raise KernelDTypeError(f"q is {q.dtype} but the cache is {k_cache.dtype}; cast one")
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _dtype(name, t, (torch.int32,))
    if out is not None:
        _tensors(out=out)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise KernelInputError(
                f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, "
                f"{out.dtype}"
            )
        tensors["out"] = out
    _same_device(**tensors)

    total_q, num_q_heads, q_dim = q.shape
    if num_q_heads < 1:
        raise KernelInputError("q has 0 heads (q.shape[1])")
    if q_dim != head_dim:
        raise KernelInputError(f"q head_dim {q_dim} differs from the cache head_dim {head_dim}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedConfigError(
            f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}"
        )
    if num_q_heads % num_kv_heads:
        raise KernelInputError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise KernelInputError(
            f"batch sizes disagree: seq_lens has {num_seqs}, block_tables "
            f"{block_tables.shape[0]}, query_start_loc {query_start_loc.shape[0]} (needs batch+1)"
        )
    _last_dim_contiguous(
        q=q,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        **({"out": out} if out is not None else {}),
    )
    return AttentionShapes(
        num_seqs=num_seqs,
        total_q=total_q,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=block_tables.shape[1],
    )


def check_attention_values(batch: PagedBatch, shapes: AttentionShapes) -> int:
    """Check lengths and the used part of every block table; returns the max sequence length."""
    qsl = batch.query_start_loc.cpu().long()
    lens = batch.seq_lens.cpu().long()
    if qsl[0] != 0 or qsl[-1] != shapes.total_q:
        raise KernelInputError(
            f"query_start_loc must start at 0 and end at total_q={shapes.total_q}, got "
            f"{qsl[0].item()} .. {qsl[-1].item()}"
        )
    q_lens = qsl[1:] - qsl[:-1]
    bad = torch.nonzero((q_lens < 1) | (lens < q_lens))
    if len(bad):
        b = int(bad[0, 0])
        raise KernelInputError(
            f"sequence {b}: needs 1 <= q_len <= seq_len, got q_len={q_lens[b].item()}, "
            f"seq_len={lens[b].item()} (seq_lens counts cached plus new tokens)"
        )
    used = -(-lens // shapes.block_size)  # [B] blocks each sequence reads
    if len(used) and int(used.max()) > shapes.max_blocks:
        b = int(used.argmax())
        raise KernelInputError(
            f"sequence {b} has {lens[b].item()} tokens = {used[b].item()} blocks of "
            f"{shapes.block_size}, but block_tables has only {shapes.max_blocks} columns"
        )
    table = batch.block_tables.cpu()
    in_use = torch.arange(shapes.max_blocks)[None, :] < used[:, None]  # [B, max_blocks]
    bad = torch.nonzero(in_use & ((table < 0) | (table >= shapes.num_blocks)))
    if len(bad):
        b, i = int(bad[0, 0]), int(bad[0, 1])
        raise KernelInputError(
            f"block_tables[{b}, {i}] = {table[b, i].item()} is outside the cache "
            f"[0, {shapes.num_blocks}); sequence {b} uses its first {used[b].item()} entries"
        )
    return int(lens.max()) if len(lens) else 0


def check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int]:
    """Checks for ``store_kv``; returns (num_blocks, block_size)."""
    _tensors(k=k, v=v, slot_mapping=slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    _rank("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    _rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise KernelInputError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = {expected} to match "
                f"slot_mapping and the cache, got {tuple(t.shape)}"
            )
        if is_fp8(k_cache):
            _dtype(name, t, FLOAT_DTYPES)
        elif t.dtype != k_cache.dtype:
            raise KernelDTypeError(f"{name} is {t.dtype} but the cache is {k_cache.dtype}; cast it")
    _dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    _same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _last_dim_contiguous(k=k, v=v, slot_mapping=slot_mapping)
    return num_blocks, block_size


def check_workspace(workspace: torch.Tensor, device: torch.device) -> None:
    """A ``workspace=`` buffer's type, dtype, rank, device and layout are checked whether or not
    a call splits, so a wrong kind of buffer fails at once; its size is checked when a call
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


def check_fp8_scales(k_scale: object, v_scale: object) -> tuple[float, float]:
    """Both per-tensor fp8 scales as floats; KernelInputError unless each is a finite number
    > 0 (a Python number or a one-element tensor, read on the host; not a bool or a string)."""
    try:
        if isinstance(k_scale, bool | str) or isinstance(v_scale, bool | str):
            raise TypeError(k_scale, v_scale)
        k, v = float(k_scale), float(v_scale)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise KernelInputError(
            f"k_scale and v_scale must be numbers, got {k_scale!r}, {v_scale!r}"
        ) from None
    if not (0 < k < math.inf and 0 < v < math.inf):
        raise KernelInputError(f"k_scale and v_scale must be finite and > 0, got {k}, {v}")
    return k, v


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot must be -1 (skip) or inside the cache."""
    slots = slot_mapping.cpu()
    bad = torch.nonzero((slots < -1) | (slots >= num_slots))
    if len(bad):
        i = int(bad[0, 0])
        raise KernelInputError(
            f"slot_mapping[{i}] = {slots[i].item()} is outside the cache [0, {num_slots}) "
            "and is not -1 (skip)"
        )
