"""What a replay runs with, resolved against the model table (capacity in blocks, bytes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.eviction import POLICIES
from prefixcache.hashing import HASH_FUNCTIONS
from prefixcache.manager import CacheManager
from prefixcache.pool import UNBOUNDED
from prefixcache.replay.model_specs import GpuConfig, ModelConfig, get_gpu, get_model
from prefixcache.replay.traces import MAX_LINE_BYTES, MAX_PROMPT_TOKENS

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
    token_budget: int = 8192  # tokens per step (prefill chunks + decodes)
    max_seqs: int = 256  # running sequences
    # fleet (serving mode): replicas of this cache size each, routed by a fleet policy
    replicas: int = 1
    routing: str | None = None  # a fleet routing policy; None: prefix_balanced with replicas > 1
    # traces
    trace_format: str | None = None
    trace_block_size: int = 512  # Mooncake tokens per hash id
    tokenizer: str | None = None
    output_len: int = 128  # for trace lines without an output length
    max_line_bytes: int = MAX_LINE_BYTES  # longer trace lines are rejected
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # longer trace prompts are rejected
    record: bool = True  # per-request rows and timeline (off in sweep workers)
    upper_bound: bool = True  # the infinite-cache shadow (memory grows with unique blocks)

    def with_(self, **changes: Any) -> ReplayConfig:
        return replace(self, **changes)

    @property
    def is_fleet(self) -> bool:
        """A fleet replay: several replicas, or a routing policy named."""
        return self.replicas > 1 or self.routing is not None

    @property
    def routing_policy(self) -> str:
        """The routing policy a fleet replay uses."""
        return self.routing or "prefix_balanced"

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
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ConfigError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.routing is not None:
            from prefixcache.fleet.routing import POLICIES as ROUTING_POLICIES

            if self.routing not in ROUTING_POLICIES:
                raise ConfigError(
                    f"unknown routing policy {self.routing!r}; choose one of "
                    f"{', '.join(sorted(ROUTING_POLICIES))}"
                )
        if self.is_fleet and self.mode != "serving":
            raise ConfigError("--replicas and --routing need --mode serving")
        model_name = self.model or (DEFAULT_SERVING_MODEL if self.mode == "serving" else None)
        model = get_model(model_name) if model_name else None
        gpu = get_gpu(self.gpu) if self.mode == "serving" else None
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
        return ResolvedConfig(self, model, blocks, capacity_bytes, bytes_per_block, gpu)


@dataclass(frozen=True)
class ResolvedConfig:
    options: ReplayConfig
    model: ModelConfig | None
    capacity_blocks: int
    capacity_bytes: int | None
    bytes_per_block: int | None
    gpu: GpuConfig | None = None  # serving mode only

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
        )

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
        if not o.upper_bound:
            out["upper_bound"] = False
        if o.mode == "serving":
            out.update(gpu=o.gpu, token_budget=o.token_budget, max_seqs=o.max_seqs)
        if o.is_fleet:
            out.update(replicas=o.replicas, routing=o.routing_policy)
        return out
