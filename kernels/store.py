"""Public ``store_kv``: write new K/V into the paged cache through a slot mapping."""

from __future__ import annotations

import torch

from prefixcache.kernels.attention import check_fp8_device
from prefixcache.kernels.backend import Backend, check_kernel_mode, resolve_backend
from prefixcache.kernels.config import StoreConfig, choose_store_config
from prefixcache.kernels.reference import reference_store_kv
from prefixcache.kernels.validation import (
    check_fp8_scales,
    check_slot_values,
    check_store_args,
    is_fp8,
)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Write k/v [num_tokens, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D].

    Token t goes to slot ``slot_mapping[t]`` (int32/int64; slot = block * block_size + offset;
    -1 skips the token). ``validate=False`` skips the slot range check (a GPU sync); the call
    then reads only metadata and allocates nothing (CUDA-graph capturable).

    fp8 caches (uint8 holding e4m3 bits, or float8_e4m3fn) store ``k / k_scale`` and
    ``v / v_scale`` saturated to +-448 and rounded to nearest even; k/v may be fp32/fp16/bf16.
    """
    num_blocks, block_size = check_store_args(k, v, k_cache, v_cache, slot_mapping)
    fp8 = is_fp8(k_cache)
    k_scale, v_scale = check_fp8_scales(k_scale, v_scale)  # for every cache, as attention does
    if validate:
        check_slot_values(slot_mapping, num_blocks * block_size)
    num_tokens, num_kv_heads, head_dim = k.shape
    use = resolve_backend(backend, k.device)  # a backend that cannot run is refused, tokens or not
    if num_tokens == 0:
        return
    if use == "torch":
        reference_store_kv(
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_scale=k_scale if fp8 else None,
            v_scale=v_scale if fp8 else None,
        )
        return

    from prefixcache.kernels.triton_store import store_kv_kernel

    check_kernel_mode(store_kv_kernel, k.device)
    if fp8:
        check_fp8_device(k.device)
    cfg = choose_store_config(num_tokens, num_kv_heads, head_dim)
    launch_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, fp8=fp8, cfg=cfg)


def launch_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    *,
    fp8: bool,
    cfg: StoreConfig,
) -> None:
    """The Triton launch behind ``store_kv`` (arguments and kernel mode checked there)."""
    from prefixcache.kernels.triton_store import store_kv_kernel

    num_tokens, num_kv_heads, head_dim = k.shape
    if fp8:  # e4m3 bits as bytes (views, no copy)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    grid = (-(-num_tokens // cfg.block_t), num_kv_heads)
    store_kv_kernel[grid](
        k_ptr=k,
        v_ptr=v,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
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
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=cfg.block_t,
        QUANT_FP8=fp8,
        num_warps=cfg.num_warps,
    )
