"""Public ``store_kv``: write new K/V into the paged cache through a slot mapping."""

from __future__ import annotations

import torch

from prefixcache.kernels.backend import Backend, check_kernel_mode, resolve_backend
from prefixcache.kernels.reference import reference_store_kv
from prefixcache.kernels.validation import check_slot_values, check_store_args

_BLOCK_T = 32  # tokens per program


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Write k/v [num_tokens, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D].

    Token t goes to slot ``slot_mapping[t]`` (int32/int64; slot = block * block_size + offset;
    -1 skips the token). ``validate=False`` skips the slot range check (a GPU sync).
    """
    num_blocks, block_size = check_store_args(k, v, k_cache, v_cache, slot_mapping)
    if validate:
        check_slot_values(slot_mapping, num_blocks * block_size)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if resolve_backend(backend, k.device) == "torch":
        reference_store_kv(k, v, k_cache, v_cache, slot_mapping)
        return

    from prefixcache.kernels.triton_store import store_kv_kernel

    check_kernel_mode(store_kv_kernel, k.device)
    grid = (-(-num_tokens // _BLOCK_T), num_kv_heads)
    store_kv_kernel[grid](
        k_ptr=k,
        v_ptr=v,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_kcb=k_cache.stride(0),
        stride_kcs=k_cache.stride(1),
        stride_kch=k_cache.stride(2),
        stride_vcb=v_cache.stride(0),
        stride_vcs=v_cache.stride(1),
        stride_vch=v_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=1 << (head_dim - 1).bit_length(),
        BLOCK_SIZE=block_size,
        BLOCK_T=_BLOCK_T,
        num_warps=4,
    )
