"""Time a random-weight decoder on this machine: the step shapes a GPU profile is fitted to.

The model has the chosen config's layers, heads, hidden and MLP sizes and vocabulary, random
weights (no download). Fresh prefill runs torch SDPA (flash on CUDA); extend and decode store
K/V into a paged cache and attend through ``prefixcache.kernels.paged_attention``. Every shape
is run ``warmup`` times, then timed ``repeats`` times with CUDA events (wall clock on CPU), and
the median kept. Also timed: a dense matmul (peak FLOP/s) and a device copy (bandwidth).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from prefixcache.kv_cache import PagedKVCache
from prefixcache.replay.calibrate.profile_fit import Measurement
from prefixcache.replay.model_specs import ModelConfig

BLOCK_SIZE = 16


class BenchShapes(NamedTuple):
    """What to time: (batch, tokens) prefills, (new, cached) extends, (batch, context) decodes,
    the matmul's side and the bytes of the bandwidth copy."""

    prefill: tuple[tuple[int, int], ...]
    extend: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    matmul: int
    copy_bytes: int


FULL_SHAPES = BenchShapes(
    prefill=((1, 8192), (8, 1024), (1, 2048)),
    extend=((1024, 7168),),
    decode=((64, 2048), (1, 8192)),
    matmul=8192,
    copy_bytes=1 << 30,
)
TINY_SHAPES = BenchShapes(
    prefill=((1, 256), (4, 64), (1, 64)),
    extend=((32, 224),),
    decode=((8, 64), (1, 256)),
    matmul=256,
    copy_bytes=1 << 22,
)
TINY_MODEL = ModelConfig(
    name="tiny-random",
    params=2 * (4 * 64 * 128 * 2 + 2 * 64 * 128 * 2 + 3 * 128 * 256) + 2 * 512 * 128,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
)


class BenchResult(NamedTuple):
    """Median step times and the device's measured peak figures."""

    measurements: list[Measurement]
    matmul_flops: float  # FLOP/s of the dense matmul
    copy_bytes_per_s: float  # bytes read plus written per second by the copy


class Timer:
    """Median seconds of a callable after warmup: CUDA events on a GPU, wall clock on CPU."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def median(self, fn: Callable[[], object]) -> float:
        """Run ``fn`` ``warmup`` times, then time it ``repeats`` times; the median in seconds."""
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        times = []
        for _ in range(self.repeats):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class RandomDecoder:
    """A Llama-style decoder (GQA attention, gated SiLU MLP) with random weights; K/V of extend
    and decode steps live in a paged cache."""

    def __init__(
        self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, num_blocks: int
    ) -> None:
        assert cfg.hidden_size and cfg.intermediate_size and cfg.vocab_size
        h, inter = cfg.hidden_size, cfg.intermediate_size
        hq, hkv, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
            return t.mul_(shape[0] ** -0.5)

        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed = w(cfg.vocab_size, h)
        self.lm_head = w(h, cfg.vocab_size)
        self.layers = [
            (w(h, (hq + 2 * hkv) * d), w(hq * d, h), w(h, 2 * inter), w(inter, h))
            for _ in range(cfg.num_layers)
        ]
        self.kv = PagedKVCache(
            cfg.num_layers, num_blocks, BLOCK_SIZE, hkv, d, dtype=dtype, device=device
        )
        self.backend: Literal["triton", "torch"] = "triton" if device.type == "cuda" else "torch"

    def forward(self, batch: int, new: int, context: int) -> torch.Tensor:
        """One step of ``batch`` sequences computing ``new`` tokens after ``context`` cached
        ones (context 0: fresh prefill through SDPA); returns the last tokens' logits."""
        from prefixcache.kernels import paged_attention, store_kv

        c, dev = self.cfg, self.device
        hq, hkv, d = c.num_attention_heads, c.num_kv_heads, c.head_dim
        ids = torch.randint(0, c.vocab_size or 1, (batch * new,), device=dev)
        x = self.embed[ids]
        paged = context > 0
        if paged:
            per_seq = -(-(context + new) // BLOCK_SIZE)
            tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, -1)
            pos = torch.arange(context, context + new, device=dev)
            slots = (tables[:, :1].long() * BLOCK_SIZE + pos).reshape(-1)
            seq_lens = torch.full((batch,), context + new, device=dev, dtype=torch.int32)
            qsl = torch.arange(0, (batch + 1) * new, new, device=dev, dtype=torch.int32)
        for layer, (w_qkv, w_o, w_gu, w_down) in enumerate(self.layers):
            q, k, v = (_rms(x) @ w_qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
            if paged:
                kc, vc = self.kv.k[layer], self.kv.v[layer]
                k3, v3 = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
                store_kv(k3, v3, kc, vc, slots, backend=self.backend, validate=False)
                attn = paged_attention(
                    q.reshape(-1, hq, d),
                    kc,
                    vc,
                    tables,
                    seq_lens,
                    qsl,
                    max_seq_len=context + new,
                    backend=self.backend,
                    validate=False,
                ).reshape(-1, hq * d)
            else:
                qb = q.view(batch, new, hq, d).transpose(1, 2)
                kb = k.view(batch, new, hkv, d).transpose(1, 2)
                vb = v.view(batch, new, hkv, d).transpose(1, 2)
                out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                attn = out.transpose(1, 2).reshape(-1, hq * d)
            x = x + attn @ w_o
            gate, up = (_rms(x) @ w_gu).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        last = x.view(batch, new, -1)[:, -1]
        return _rms(last) @ self.lm_head


def blocks_needed(shapes: BenchShapes) -> int:
    """Paged-cache blocks the largest extend or decode shape needs."""
    need = [-(-(c + n) // BLOCK_SIZE) for n, c in shapes.extend]
    need += [b * -(-(c + 1) // BLOCK_SIZE) for b, c in shapes.decode]
    return max(need, default=1)


def run_bench(
    cfg: ModelConfig,
    shapes: BenchShapes,
    device: torch.device,
    dtype: torch.dtype,
    *,
    warmup: int = 3,
    repeats: int = 10,
) -> BenchResult:
    """Time every shape of ``shapes`` on a random-weight ``cfg``, plus the matmul and copy."""
    timer = Timer(device, warmup, repeats)
    with torch.inference_mode():
        n = shapes.matmul
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        matmul_flops = 2 * n**3 / timer.median(partial(torch.matmul, a, b))
        a = b = torch.empty(0)
        src = torch.empty(shapes.copy_bytes // 2, device=device, dtype=torch.float16)
        dst = torch.empty_like(src)
        copy_bw = 2 * shapes.copy_bytes / timer.median(partial(dst.copy_, src))
        src = dst = torch.empty(0)
        model = RandomDecoder(cfg, device, dtype, blocks_needed(shapes))
        out: list[Measurement] = []
        for batch, tokens in shapes.prefill:
            s = timer.median(partial(model.forward, batch, tokens, 0))
            out.append(Measurement("prefill", batch, tokens, 0, s))
        for new, context in shapes.extend:
            s = timer.median(partial(model.forward, 1, new, context))
            out.append(Measurement("extend", 1, new, context, s))
        for batch, context in shapes.decode:
            s = timer.median(partial(model.forward, batch, 1, context))
            out.append(Measurement("decode", batch, 1, context, s))
    return BenchResult(out, matmul_flops, copy_bw)
