"""The memory tiers below the GPU cache of a replay: sizes, link bandwidths, transfer costs.

``--host-memory`` gives every replica a host-memory tier (the manager's ``host_blocks``): blocks
evicted from the GPU are offloaded there and loaded back over PCIe. ``--pool-memory`` adds one
pool shared by all replicas (a disaggregated KV store such as Mooncake's store or LMCache's
remote backend), read over the network. ``--pool-write`` says when a block enters the pool:

* ``evict`` (the default): when it leaves a replica's lowest local tier (host evictions with a
  host tier, GPU evictions without), so a block a replica still holds is in no other replica's
  reach. The default, so that runs without the option replay as before.
* ``through``: as soon as a replica computes it (every full prompt block an admission computes),
  as Mooncake's store and LMCache's remote backends are fed: a block one replica holds is found
  by every other replica too.

Default link bandwidths, per direction:

* host: 55 GB/s, PCIe Gen5 x16. The link carries 32 GT/s per lane over 16 lanes with 128b/130b
  encoding, about 63 GB/s (PCI-SIG, PCI Express Base Specification 5.0); pinned-memory copies
  reach about 55 GB/s of it.
* pool: 25 GB/s, one 200 Gb/s RDMA NIC (e.g. NVIDIA ConnectX-7 at 200 Gb/s): 200e9 / 8 bytes.

A run of blocks is loaded only when moving it costs less time than recomputing it: ``bytes per
block / bandwidth`` against ``block size x 2 x layer parameters / (peak FLOPs x tp x MFU)``, the
MFU being the serving roofline's compute efficiency (its GPU's, 0.5 without a fitted profile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.manager.lower_tiers.transfers import TransferModel
from prefixcache.replay.model_specs import (
    DEFAULT_COMPUTE_EFFICIENCY,
    GpuConfig,
    ModelConfig,
    get_gpu,
)

DEFAULT_HOST_BANDWIDTH = 55e9  # bytes/s: PCIe Gen5 x16, per direction, achieved
DEFAULT_POOL_BANDWIDTH = 25e9  # bytes/s: one 200 Gb/s RDMA NIC
POOL_WRITE_POLICIES = ("evict", "through")  # when a block enters the pool
DEFAULT_POOL_WRITE = "evict"


@dataclass(frozen=True)
class TierConfig:
    """The tiers of one replay, resolved into blocks and transfer models."""

    host_blocks: int  # per replica (0: no host tier)
    host_bytes: int
    pool_blocks: int  # shared by all replicas (0: no pool)
    pool_bytes: int
    host_bandwidth: float
    pool_bandwidth: float
    bytes_per_block: int
    recompute_seconds_per_token: float  # prefill compute time of one token
    recompute_mfu: float  # the serving roofline's compute efficiency it assumes
    host_transfer: TransferModel
    pool_transfer: TransferModel
    pool_write: str = DEFAULT_POOL_WRITE  # POOL_WRITE_POLICIES

    def load_seconds(self, host_blocks: int, pool_blocks: int) -> float:
        """Seconds to move ``host_blocks`` over the host link and ``pool_blocks`` over the
        pool link (one after the other)."""
        bpb = self.bytes_per_block
        return host_blocks * bpb / self.host_bandwidth + pool_blocks * bpb / self.pool_bandwidth

    def report_dict(self) -> dict[str, Any]:
        """The tier settings for the run's config."""
        return {
            "host_blocks": self.host_blocks,
            "host_bytes": self.host_bytes,
            "host_bandwidth_bytes_per_s": self.host_bandwidth,
            "pool_blocks": self.pool_blocks,
            "pool_bytes": self.pool_bytes,
            "pool_bandwidth_bytes_per_s": self.pool_bandwidth,
            "pool_write": self.pool_write,
            "recompute_mfu": self.recompute_mfu,
        }


def resolve_tiers(
    host_memory: int | None,
    pool_memory: int | None,
    host_bandwidth: float,
    pool_bandwidth: float,
    model: ModelConfig | None,
    gpu: GpuConfig | None,
    gpu_name: str,
    block_size: int,
    tp: int,
    pool_write: str = DEFAULT_POOL_WRITE,
) -> TierConfig | None:
    """Size the tiers of a replay (``gpu``: the serving GPU, else ``gpu_name`` is looked up
    for the recompute cost); None when neither is asked for. Raises ConfigError with what
    to change."""
    if pool_write not in POOL_WRITE_POLICIES:
        raise ConfigError(
            f"unknown pool write policy {pool_write!r}; choose one of "
            f"{', '.join(POOL_WRITE_POLICIES)}"
        )
    if pool_write != DEFAULT_POOL_WRITE and pool_memory is None:
        raise ConfigError(
            f"--pool-write {pool_write} needs --pool-memory: without a pool it does nothing"
        )
    if host_memory is None and pool_memory is None:
        return None
    for name, value in (("--host-memory", host_memory), ("--pool-memory", pool_memory)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ConfigError(f"{name} must be a size in bytes, got {value!r}")
    for name, bw in (("--host-bw", host_bandwidth), ("--pool-bw", pool_bandwidth)):
        if isinstance(bw, bool) or not isinstance(bw, int | float) or not 0 < bw < float("inf"):
            raise ConfigError(f"{name} must be a positive number of bytes per second, got {bw!r}")
    if model is None:
        raise ConfigError(
            "--host-memory and --pool-memory need --model to convert bytes into blocks "
            "(layers x KV heads x head_dim x dtype)"
        )
    bpb = model.bytes_per_block(block_size)
    host_blocks = (host_memory or 0) // bpb
    pool_blocks = (pool_memory or 0) // bpb
    for name, size, blocks in (
        ("--host-memory", host_memory, host_blocks),
        ("--pool-memory", pool_memory, pool_blocks),
    ):
        if size and not blocks:
            raise ConfigError(
                f"{name} {size} bytes hold no block of {bpb} bytes ({block_size} tokens of "
                f"{model.name})"
            )
    if gpu is None:
        gpu = get_gpu(gpu_name)
    flops_per_token = 2.0 * model.layer_flops_params
    pair = float(model.attention_flops_per_pair)
    mfu = gpu.compute_efficiency  # a fitted profile's, as the step times use
    mfu = DEFAULT_COMPUTE_EFFICIENCY if mfu is None else mfu
    flops = gpu.peak_flops * tp * mfu
    return TierConfig(
        host_blocks,
        host_memory or 0,
        pool_blocks,
        pool_memory or 0,
        float(host_bandwidth),
        float(pool_bandwidth),
        bpb,
        flops_per_token / flops,
        mfu,
        TransferModel(bpb, float(host_bandwidth), flops_per_token, flops, pair),
        TransferModel(bpb, float(pool_bandwidth), flops_per_token, flops, pair),
        pool_write,
    )
