"""Torch reference attention: the definition of truth the paged kernels are checked against."""

from __future__ import annotations

import math

import torch

from prefixcache.kernels.batch import PagedBatch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention for one sequence, GQA/MQA aware, computed in fp32.

    q: [Tq, Hq, D] (the last Tq positions of the sequence), k/v: [Tk, Hkv, D] with Tk >= Tq.
    Causal masking is bottom-right aligned: query i sits at position Tk - Tq + i.
    Returns [Tq, Hq, D] in q's dtype; ``lse_out`` [Tq, Hq] receives each row's log-sum-exp of the
    scaled scores (natural log).
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    scores = (qf @ kf.transpose(-2, -1)) * scale  # [Hq, Tq, Tk]
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        kpos = torch.arange(tk, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(scores, dim=-1).transpose(0, 1))
    out = torch.softmax(scores, dim=-1) @ vf  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype)


def dequantize_fp8(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 values (float8_e4m3fn, or their bits as uint8) times ``scale``, in fp32."""
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    return cache.float() * scale


FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to nearest-even e4m3, as float8_e4m3fn.

    The division is IEEE on every device: torch divides a CUDA tensor by a Python number as a
    multiplication by its reciprocal, which can land one ulp off and flip an e4m3 tie, so the
    scale is a tensor on x's device here.
    """
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, gathered from a paged cache.

    cache: [num_blocks, block_size, Hkv, D], block_table: [>= cdiv(length, block_size)] ids.
    Returns [length, Hkv, D]. Table entries past the last used block are never read.
    """
    block_size = cache.shape[1]
    used = -(-length // block_size)
    ids = block_table[:used].to(device=cache.device, dtype=torch.long)
    return cache[ids].flatten(0, 1)[:length]


def reference_paged_attention(
    batch: PagedBatch | torch.Tensor,
    *tensors: torch.Tensor,
    scale: float | None = None,
    lse_out: torch.Tensor | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """Varlen paged attention by gathering each sequence and running ``reference_attention``.

    ``batch``: a ``PagedBatch``, or its six tensors in order as ``paged_attention`` takes them
    (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc). q: [total_q, Hq, D] packed;
    sequence b owns rows query_start_loc[b]:query_start_loc[b+1], the last q_len of its
    seq_lens[b] tokens. Returns [total_q, Hq, D] in q's dtype. ``lse_out`` [total_q, Hq] receives
    the rows' log-sum-exp. With ``k_scale``/``v_scale`` the caches hold e4m3 values (see
    ``dequantize_fp8``).
    """
    if not isinstance(batch, PagedBatch):
        batch = PagedBatch(batch, *tensors)
    out = torch.empty_like(batch.q)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        k = gather_kv(batch.k_cache, batch.block_tables[b], seq_len)  # [seq_len, Hkv, D]
        v = gather_kv(batch.v_cache, batch.block_tables[b], seq_len)  # [seq_len, Hkv, D]
        if k_scale is not None or v_scale is not None:
            k = dequantize_fp8(k, 1.0 if k_scale is None else k_scale)
            v = dequantize_fp8(v, 1.0 if v_scale is None else v_scale)
        lse = None if lse_out is None else lse_out[lo:hi]
        out[lo:hi] = reference_attention(
            batch.q[lo:hi], k, v, causal=True, scale=scale, lse_out=lse
        )
    return out


def reference_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Write k/v [n, Hkv, D] into the caches at ``slot_mapping`` [n] (slot -1 = skip), in place.

    With ``k_scale``/``v_scale`` the caches are fp8 and receive ``quantize_fp8(x, scale)``.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scale is None:
            cache[blocks, offsets] = x[keep].to(cache.dtype)
        else:
            cache[blocks, offsets] = quantize_fp8(x[keep], scale).view(cache.dtype)
