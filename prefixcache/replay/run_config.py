"""What a replay runs with, resolved against the model table (capacity in blocks, bytes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from prefixcache.blocks.eviction import POLICIES
from prefixcache.blocks.hashing import HASH_FUNCTIONS
from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.errors import ConfigError
from prefixcache.fleet.policies import DEFAULT_POLICY
from prefixcache.fleet.policies import POLICIES as ROUTING_POLICIES
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.tenant_shares import TenantShare
from prefixcache.replay.model_specs import GpuConfig, ModelConfig, get_gpu, get_model
from prefixcache.replay.share_specs import ShareSpec, resolve_shares, shares_text
from prefixcache.replay.tiers.sizes import (
    DEFAULT_HOST_BANDWIDTH,
    DEFAULT_POOL_BANDWIDTH,
    DEFAULT_POOL_WRITE,
    TierConfig,
    resolve_tiers,
)
from prefixcache.replay.workload.traces import MAX_LINE_BYTES, MAX_PROMPT_TOKENS

MODES = ("sequential", "serving")
DEFAULT_SERVING_MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class ReplayConfig:
    capacity_blocks: int | None = None  # cache size in blocks (UNBOUNDED: never full), or
    kv_memory: int | None = None  # cache size in bytes (needs model)
    block_size: int = 16
    model: str | None = None  # table name or model file; serving defaults to 8B
    policy: str = "lru"
    mode: str = "sequential"
    seed: int | None = None  # overrides the scenario's seed; trace token synthesis
    hash_algo: str = "xxh3_128"
    partial_copy: bool = True
    # serving simulation
    gpu: str = "h100-sxm"
    gpu_profile: str | None = None  # a GPU profile file (prefixcache calibrate): replaces gpu
    token_budget: int = 8192  # tokens per step (prefill chunks + decodes)
    max_seqs: int = 256  # running sequences
    tp: int = 1  # tensor-parallel GPUs per replica: weights and KV split, compute multiplied
    rate_scale: float = 1.0  # arrivals this many times as fast (timestamps divided)
    time_scale: float = 1.0  # timestamps multiplied (2.0: the trace stretched to twice its span)
    # fleet (serving mode): replicas of this cache size each, routed by a fleet policy
    replicas: int = 1
    routing: str | None = None  # a fleet routing policy; None: prefix
    # traces
    trace_format: str | None = None
    trace_block_size: int = 512  # Mooncake tokens per hash id
    tokenizer: str | None = None
    chat_template: str | None = None  # .jinja or tokenizer_config.json for chat trace lines
    output_len: int = 128  # for trace lines without an output length
    max_line_bytes: int = MAX_LINE_BYTES  # longer trace lines are rejected
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # longer trace prompts are rejected
    continuations: bool | None = None  # Mooncake multi-turn continuations; None: the default
    record: bool = True  # per-request rows and timeline (off in sweep workers)
    # memory tiers below the GPU cache (prefixcache.replay.tiers.sizes)
    host_memory: int | None = None  # host-memory tier per replica, bytes (needs model)
    pool_memory: int | None = None  # one pool shared by all replicas, bytes (needs model)
    host_bw: float = DEFAULT_HOST_BANDWIDTH  # host <-> GPU bytes/s
    pool_bw: float = DEFAULT_POOL_BANDWIDTH  # pool <-> GPU bytes/s
    pool_write: str = DEFAULT_POOL_WRITE  # when blocks enter the pool: evict or through
    upper_bound: bool = True  # the infinite-cache shadow (memory grows with unique blocks)
    # tenant shares of each replica's GPU cache (share_specs.py); () per-tenant figures only,
    # None no tenant accounting
    shares: tuple[ShareSpec, ...] | None = None

    def with_(self, **changes: Any) -> ReplayConfig:
        return replace(self, **changes)

    @property
    def is_fleet(self) -> bool:
        """A fleet replay: several replicas, or a routing policy named."""
        return self.replicas > 1 or self.routing is not None

    @property
    def arrival_factor(self) -> float:
        """What every arrival time is multiplied by: time_scale / rate_scale."""
        return self.time_scale / self.rate_scale

    @property
    def routing_policy(self) -> str:
        """The routing policy a fleet replay uses."""
        return self.routing or DEFAULT_POLICY

    def resolve(self) -> ResolvedConfig:
        """Check every option and size the cache; raises ConfigError with what to change."""
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}"
            )
        if self.hash_algo not in HASH_FUNCTIONS:
            raise ConfigError(
                f"unknown hash {self.hash_algo!r}; choose one of "
                f"{', '.join(sorted(HASH_FUNCTIONS))}"
            )
        for name in (
            "block_size",
            "token_budget",
            "max_seqs",
            "trace_block_size",
            "max_line_bytes",
            "max_prompt_tokens",
            "tp",
            "replicas",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("rate_scale", "time_scale"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < float("inf")
            ):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.mode != "serving" and (
            self.tp != 1 or self.rate_scale != 1.0 or self.time_scale != 1.0
        ):  # each alone: two that cancel out are still ignored
            raise ConfigError("--tp, --rate-scale and --time-scale need --mode serving")
        defaults = ReplayConfig()
        if self.mode != "serving" and (
            self.token_budget != defaults.token_budget or self.max_seqs != defaults.max_seqs
        ):
            raise ConfigError("--token-budget and --max-seqs need --mode serving")
        if self.routing is not None and self.routing not in ROUTING_POLICIES:
            raise ConfigError(
                f"unknown routing policy {self.routing!r}; choose one of "
                f"{', '.join(sorted(ROUTING_POLICIES))}"
            )
        if self.is_fleet and self.mode != "serving":
            raise ConfigError("--replicas and --routing need --mode serving")
        model_name = self.model or (DEFAULT_SERVING_MODEL if self.mode == "serving" else None)
        model = get_model(model_name) if model_name else None
        gpu = self._serving_gpu()
        bytes_per_block = model.bytes_per_block(self.block_size) if model else None
        if self.capacity_blocks is not None:
            if self.kv_memory is not None:
                raise ConfigError("give the cache size once: blocks or KV memory, not both")
            blocks = self.capacity_blocks
            if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
                raise ConfigError(f"capacity must be a positive number of blocks, got {blocks!r}")
            unbounded = blocks >= UNBOUNDED
            capacity_bytes = blocks * bytes_per_block if bytes_per_block and not unbounded else None
        elif self.kv_memory is not None:
            if bytes_per_block is None:
                raise ConfigError(
                    "--kv-memory needs --model to convert bytes into blocks "
                    "(layers x KV heads x head_dim x dtype)"
                )
            blocks = self.kv_memory // bytes_per_block
            if blocks < 1:
                raise ConfigError(
                    f"{self.kv_memory} bytes hold no block of {bytes_per_block} "
                    f"bytes ({self.block_size} tokens of {model_name})"
                )
            capacity_bytes = self.kv_memory
        else:
            raise ConfigError("give the cache size: --blocks N, or --kv-memory SIZE with --model")
        if model is not None and gpu is not None and capacity_bytes is not None:
            check_fits(model, gpu, capacity_bytes, self.tp)
        tiers = resolve_tiers(
            self.host_memory,
            self.pool_memory,
            self.host_bw,
            self.pool_bw,
            model,
            gpu,
            self.gpu,
            self.block_size,
            self.tp,
            self.pool_write,
        )
        if self.shares:
            resolve_shares(self.shares, blocks)  # ConfigError now, not in a worker
        return ResolvedConfig(self, model, blocks, capacity_bytes, bytes_per_block, gpu, tiers)

    def _serving_gpu(self) -> GpuConfig | None:
        """The roofline's GPU: the profile file when given, else the table's entry."""
        if self.gpu_profile is not None and self.mode != "serving":
            raise ConfigError("--gpu-profile needs --mode serving")
        if self.mode != "serving":
            return None
        if self.gpu_profile is None:
            return get_gpu(self.gpu)
        from prefixcache.replay.calibrate.gpu_profile import load_profile

        return load_profile(self.gpu_profile).gpu_config()


def check_fits(model: ModelConfig, gpu: GpuConfig, kv_bytes: int, tp: int) -> None:
    """Raise ConfigError when the weights plus the KV cache, split over ``tp`` GPUs, exceed one
    GPU's memory (activations and the runtime need more still)."""
    if gpu.memory_bytes is None:
        return
    per_gpu = (model.weight_bytes + kv_bytes) / tp
    if per_gpu <= gpu.memory_bytes:
        return
    gib = 2**30
    need = -(-(model.weight_bytes + kv_bytes) // gpu.memory_bytes)
    raise ConfigError(
        f"{model.name} does not fit: {model.weight_bytes / gib:.1f} GiB of weights + "
        f"{kv_bytes / gib:.1f} GiB of KV cache over {tp} GPU(s) is {per_gpu / gib:.1f} GiB per "
        f"GPU, but one {gpu.name} holds {gpu.memory_bytes / gib:.1f} GiB; shrink --blocks / "
        f"--kv-memory or use --tp {need} or more"
    )


@dataclass(frozen=True)
class ResolvedConfig:
    options: ReplayConfig
    model: ModelConfig | None
    capacity_blocks: int
    capacity_bytes: int | None
    bytes_per_block: int | None
    gpu: GpuConfig | None = None  # serving mode only
    tiers: TierConfig | None = None  # host / pool tiers, when asked for

    def cache_manager(self, *, caching: bool = True) -> CacheManager:
        """A fresh, empty cache of this size and policy (``caching=False``: the no-cache
        baseline, which never reuses a block)."""
        o = self.options
        return CacheManager(
            self.capacity_blocks,
            o.block_size,
            hash_algo=o.hash_algo,
            policy=o.policy,
            partial_copy=o.partial_copy,
            enable_caching=caching,
            shares=self.tenant_shares() if caching else None,
            **self._host_tier(caching),
        )

    def tenant_shares(self) -> dict[str, TenantShare] | None:
        """Each replica's tenant shares in blocks ({} per-tenant figures only; None none)."""
        shares = self.options.shares
        return None if shares is None else resolve_shares(shares, self.capacity_blocks)

    def _host_tier(self, caching: bool) -> dict[str, Any]:
        """The manager's host-tier arguments (none without a host tier or without caching)."""
        tiers = self.tiers
        if tiers is None or not tiers.host_blocks or not caching:
            return {}
        return {"host_blocks": tiers.host_blocks, "transfer_model": tiers.host_transfer}

    def report_dict(self, seed: int | None) -> dict[str, Any]:
        o = self.options
        out: dict[str, Any] = {
            "block_size": o.block_size,
            "capacity_blocks": self.capacity_blocks,
            "capacity_bytes": self.capacity_bytes,
            "bytes_per_block": self.bytes_per_block,
            "policy": o.policy,
            "mode": o.mode,
            "seed": seed,
            "hash_algo": o.hash_algo,
            "model": self.model.name if self.model else None,
            "partial_copy": o.partial_copy,
        }
        if o.mode == "serving" and o.model is None:
            out["model_defaulted"] = True
        if not o.upper_bound:
            out["upper_bound"] = False
        if o.mode == "serving":
            gpu = self.gpu.name if self.gpu is not None else o.gpu
            out.update(gpu=gpu, token_budget=o.token_budget, max_seqs=o.max_seqs, tp=o.tp)
            if o.gpu_profile is not None:
                out["gpu_profile"] = str(o.gpu_profile)
            if o.arrival_factor != 1.0:
                out.update(rate_scale=o.rate_scale, time_scale=o.time_scale)
        if o.is_fleet:
            out.update(replicas=o.replicas, routing=o.routing_policy)
        if self.tiers is not None:
            out["tiers"] = self.tiers.report_dict()
        if o.shares is not None:
            out["shares"] = shares_text(o.shares)
        return out
