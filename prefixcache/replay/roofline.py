"""Step time of a batch from a roofline: the slower of compute and memory traffic, plus overhead.

Compute: 2 x (active) params per token through the weights, plus attention (4 x layers x heads x
head_dim per query-key pair). Memory: the weights once per step, plus the KV each token attends.
Deliberately simple: enough to turn saved prefill tokens into time-to-first-token estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.replay.models import GpuConfig, ModelConfig


@dataclass(frozen=True)
class Roofline:
    model: ModelConfig
    gpu: GpuConfig
    compute_efficiency: float = 0.5  # achieved fraction of peak FLOPs
    memory_efficiency: float = 0.8  # achieved fraction of HBM bandwidth
    step_overhead_s: float = 2e-3  # scheduling, sampling, launch

    def step_seconds(self, tokens: int, attention_pairs: int, kv_tokens_read: int) -> float:
        """``tokens`` computed this step, ``attention_pairs`` query-key pairs over all of them,
        ``kv_tokens_read`` context tokens whose K/V the step reads."""
        m = self.model
        flops = 2.0 * m.flops_params * tokens + m.attention_flops_per_pair * attention_pairs
        traffic = m.weight_bytes + m.kv_bytes_per_token * kv_tokens_read
        compute = flops / (self.gpu.peak_flops * self.compute_efficiency)
        memory = traffic / (self.gpu.hbm_bytes_per_s * self.memory_efficiency)
        return max(compute, memory) + self.step_overhead_s


def prefill_pairs(context: int, new: int) -> int:
    """Query-key pairs of ``new`` tokens after ``context`` cached ones (causal)."""
    return new * context + new * (new + 1) // 2
