"""The serving simulation's step-time model: a roofline over what one step computes and reads.

A step lasts as long as the roofline says: the slower of compute and memory traffic, plus a fixed
overhead. Compute: 2 x (active) layer params per computed token (the embedding is a lookup, no
FLOPs), 2 x hidden x vocab for each position whose logits are sampled (a prefill's last token and
every decode token, not every prompt token), plus attention (4 x layers x heads x head_dim per
query-key pair). Memory: the weights once per step, plus the K/V each token attends. Tensor
parallelism over ``tp`` GPUs multiplies peak FLOPs and bandwidth by ``tp`` (communication is not
modelled). Deliberately simple: enough to turn saved prefill tokens into time-to-first-token
estimates; the efficiencies below are assumptions, shown in every report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.replay.model_specs import DEFAULT_COMPUTE_EFFICIENCY, GpuConfig, ModelConfig


@dataclass(frozen=True)
class Roofline:
    """The seconds a step takes on one replica's GPUs, from what it computes and reads."""

    model: ModelConfig
    gpu: GpuConfig
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY  # achieved fraction of peak FLOPs
    memory_efficiency: float = 0.8  # achieved fraction of HBM bandwidth
    step_overhead_s: float = 2e-3  # scheduling, sampling, launch
    tp: int = 1  # tensor-parallel GPUs: compute and bandwidth multiplied
    # attention among a step's new tokens, and over K/V already cached (extend and decode);
    # None: compute_efficiency
    attention_efficiency: float | None = None
    context_attention_efficiency: float | None = None

    @classmethod
    def for_gpu(cls, model: ModelConfig, gpu: GpuConfig, tp: int = 1) -> Roofline:
        """The roofline with the efficiencies ``gpu`` sets (a fitted profile), else defaults."""
        return cls(model, gpu, tp=tp, **gpu.efficiencies())

    def step_seconds(
        self,
        tokens: int,
        attention_pairs: int,
        kv_tokens_read: int,
        logits: int,
        context_pairs: int = 0,
    ) -> float:
        """``tokens`` computed this step, ``attention_pairs`` query-key pairs over all of them,
        ``kv_tokens_read`` context tokens whose K/V the step reads, ``logits`` positions whose
        next-token logits are computed (one per decoding sequence and finished prefill);
        ``context_pairs``: the part of ``attention_pairs`` whose key was cached before the step
        (timed at the context attention efficiency when one is set)."""
        m = self.model
        peak = self.gpu.peak_flops * self.tp
        dense = 2.0 * m.layer_flops_params * tokens + m.lm_head_flops * logits
        if self.attention_efficiency is None and self.context_attention_efficiency is None:
            flops = dense + m.attention_flops_per_pair * attention_pairs
            compute = flops / (peak * self.compute_efficiency)
        else:
            fresh_eff = self.attention_efficiency or self.compute_efficiency
            context_eff = self.context_attention_efficiency or fresh_eff
            pair = m.attention_flops_per_pair
            compute = (
                dense / (peak * self.compute_efficiency)
                + pair * (attention_pairs - context_pairs) / (peak * fresh_eff)
                + pair * context_pairs / (peak * context_eff)
            )
        traffic = m.weight_bytes + m.kv_bytes_per_token * kv_tokens_read
        memory = traffic / (self.gpu.hbm_bytes_per_s * self.tp * self.memory_efficiency)
        return max(compute, memory) + self.step_overhead_s

    def timer(self) -> StepTimer:
        """``step_seconds`` with the model's and GPU's figures read once (bit for bit the same
        seconds), for loops that time one step after another."""
        m = self.model
        peak = self.gpu.peak_flops * self.tp
        split = not (
            self.attention_efficiency is None and self.context_attention_efficiency is None
        )
        fresh_eff = self.attention_efficiency or self.compute_efficiency
        context_eff = self.context_attention_efficiency or fresh_eff
        return StepTimer(
            2.0 * m.layer_flops_params,
            m.lm_head_flops,
            m.attention_flops_per_pair,
            split,
            peak * self.compute_efficiency,
            peak * fresh_eff,
            peak * context_eff,
            m.weight_bytes,
            m.kv_bytes_per_token,
            self.gpu.hbm_bytes_per_s * self.tp * self.memory_efficiency,
            self.step_overhead_s,
        )

    def assumptions(self) -> dict[str, Any]:
        """What the step times rest on, for the report."""
        out: dict[str, Any] = {
            "gpu": self.gpu.name,
            "tp": self.tp,
            "peak_flops_per_gpu": self.gpu.peak_flops,
            "hbm_bytes_per_s_per_gpu": self.gpu.hbm_bytes_per_s,
            "gpu_memory_bytes": self.gpu.memory_bytes,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "step_overhead_s": self.step_overhead_s,
            "weight_bytes": self.model.weight_bytes,
        }
        if self.attention_efficiency is not None:
            out["attention_efficiency"] = self.attention_efficiency
        if self.context_attention_efficiency is not None:
            out["context_attention_efficiency"] = self.context_attention_efficiency
        return out


def prefill_pairs(context: int, new: int) -> int:
    """Query-key pairs of ``new`` tokens after ``context`` cached ones (causal)."""
    return new * context + new * (new + 1) // 2


def context_pairs(context: int, new: int) -> int:
    """The query-key pairs of ``prefill_pairs`` whose key was cached before (``new`` x
    ``context``)."""
    return new * context


@dataclass(slots=True)
class StepWork:
    """What one step computes and reads, for the roofline."""

    tokens: int = 0
    attention_pairs: int = 0
    kv_tokens_read: int = 0
    logits: int = 0
    transfer_s: float = 0.0  # host and pool loads of the step's admissions
    context_pairs: int = 0  # of attention_pairs: keys cached before the step

    def add(
        self, tokens: int, attention_pairs: int, kv_tokens_read: int, logits: int, context: int
    ) -> None:
        """Count one request's share of the step: ``context`` of its ``attention_pairs`` have a
        key cached before the step."""
        self.tokens += tokens
        self.attention_pairs += attention_pairs
        self.kv_tokens_read += kv_tokens_read
        self.logits += logits
        self.context_pairs += context


class StepTimer:
    """``Roofline.step_seconds`` with its constants computed once: the same operations on the
    same values in the same order, so the same float for every step."""

    __slots__ = (
        "context_peak",
        "dense_coefficient",
        "fresh_peak",
        "kv_bytes_per_token",
        "lm_head_flops",
        "memory_rate",
        "overhead",
        "pair_flops",
        "peak",
        "split",
        "weight_bytes",
    )

    def __init__(
        self,
        dense_coefficient: float,
        lm_head_flops: int,
        pair_flops: int,
        split: bool,
        peak: float,
        fresh_peak: float,
        context_peak: float,
        weight_bytes: int,
        kv_bytes_per_token: int,
        memory_rate: float,
        overhead: float,
    ) -> None:
        self.dense_coefficient = dense_coefficient  # 2.0 x layer parameters
        self.lm_head_flops = lm_head_flops
        self.pair_flops = pair_flops
        self.split = split  # attention timed at its own efficiencies
        self.peak = peak  # achieved FLOPs of the dense layers (all of compute unless split)
        self.fresh_peak = fresh_peak  # ... of attention among the step's new tokens
        self.context_peak = context_peak  # ... of attention over cached K/V
        self.weight_bytes = weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.memory_rate = memory_rate  # achieved bytes per second
        self.overhead = overhead

    def seconds(
        self, tokens: int, attention_pairs: int, kv_tokens_read: int, logits: int, context: int
    ) -> float:
        """What ``Roofline.step_seconds`` returns for the same arguments."""
        dense = self.dense_coefficient * tokens + self.lm_head_flops * logits
        if self.split:
            pair = self.pair_flops
            compute = (
                dense / self.peak
                + pair * (attention_pairs - context) / self.fresh_peak
                + pair * context / self.context_peak
            )
        else:
            compute = (dense + self.pair_flops * attention_pairs) / self.peak
        traffic = self.weight_bytes + self.kv_bytes_per_token * kv_tokens_read
        memory = traffic / self.memory_rate
        return max(compute, memory) + self.overhead
