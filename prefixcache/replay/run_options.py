"""The ``prefixcache replay`` options, and the run configurations they describe.

``add_replay_parser`` defines the command's options; ``sweep_configs`` checks how they combine
and turns them into one ``ReplayConfig`` per sweep point, the primary run first.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from prefixcache.blocks.eviction import POLICIES
from prefixcache.blocks.hashing import HASH_FUNCTIONS
from prefixcache.errors import ConfigError
from prefixcache.fleet.policies import DEFAULT_POLICY
from prefixcache.fleet.policies import POLICIES as ROUTING_POLICIES
from prefixcache.replay import cli_args
from prefixcache.replay.model_specs import gpu_names, model_names
from prefixcache.replay.run_config import MODES, ReplayConfig
from prefixcache.replay.share_specs import parse_shares
from prefixcache.replay.sweep_executors import EXECUTORS
from prefixcache.replay.tiers.sizes import (
    DEFAULT_HOST_BANDWIDTH,
    DEFAULT_POOL_BANDWIDTH,
    DEFAULT_POOL_WRITE,
    POOL_WRITE_POLICIES,
)


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand and its options; the caller sets ``func``."""
    rp: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="replay a scenario or trace through the cache and report hit rates",
        description="Replay a scenario file (YAML/TOML) or a trace (Mooncake JSONL, token or "
        "prompt JSONL, text) through the cache manager. Comma-separated --blocks, --kv-memory, "
        "--block-size or --policy values run a sweep in parallel processes; the first value of "
        "each is the primary run, written in full.",
    )
    rp.add_argument(
        "source",
        metavar="SCENARIO_OR_TRACE",
        help="scenario file (YAML/TOML) or trace (Mooncake JSONL, token or prompt JSONL, text)",
    )
    size = rp.add_argument_group("cache size (one of)")
    size.add_argument(
        "--blocks",
        type=cli_args.blocks_list,
        help="capacity in blocks, e.g. 1000,5859,10000; inf: a cache that never evicts",
    )
    size.add_argument(
        "--kv-memory",
        type=cli_args.positive_size_list,
        metavar="SIZE",
        help="KV memory, e.g. 40GiB (needs --model in sequential mode; serving mode "
        "assumes llama-3.1-8b without one)",
    )
    rp.add_argument(
        "--block-size",
        type=cli_args.int_list,
        default=None,
        help="tokens per block (default: the trace's own block size for Mooncake traces, "
        "see --trace-block-size; 16 otherwise)",
    )
    rp.add_argument(
        "--model",
        help=f"for bytes and FLOPs: {', '.join(model_names())}, or a "
        "JSON/YAML model file or Hugging Face config.json (serving mode: llama-3.1-8b "
        "when not given, and the summary says so)",
    )
    rp.add_argument(
        "--policy",
        type=cli_args.str_list,
        default=["lru"],
        help=f"eviction policy: {', '.join(sorted(POLICIES))} (lru)",
    )
    rp.add_argument(
        "--shares",
        metavar="TENANT=GUARANTEE[:CAP],...",
        help="tenant shares of each replica's GPU cache, in blocks or percent (acme=25%%,"
        "globex=512:1024): a tenant keeps its guarantee through other tenants' evictions and "
        "evicts its own blocks past its cap; the report adds per-tenant figures and the same "
        "replay without shares. 'none': per-tenant figures only",
    )
    rp.add_argument(
        "--mode",
        choices=MODES,
        default="sequential",
        help="sequential: one request at a time, hit rates only; serving: continuous batching "
        "timed by a roofline model, with throughput and latency (sequential)",
    )
    rp.add_argument(
        "--seed",
        type=cli_args.seed,
        help="override the scenario's seed / trace token seed (a non-negative integer)",
    )
    rp.add_argument(
        "--out",
        type=Path,
        help="run directory (default runs/NAME-TIMESTAMP); one that holds files is refused "
        "unless --force is given",
    )
    rp.add_argument(
        "--force",
        action="store_true",
        help="write the run into an --out directory that holds files already, replacing the "
        "run there",
    )
    rp.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="stdout: a summary or report.json",
    )
    rp.add_argument(
        "--hash-algo",
        default="xxh3_128",
        help=f"block digest function: {', '.join(sorted(HASH_FUNCTIONS))} (xxh3_128)",
    )
    rp.add_argument(
        "--strict",
        action="store_true",
        help="exit 3 when requests were rejected (larger than the whole cache) or the serving "
        "simulation is overloaded",
    )
    rp.add_argument(
        "--no-partial-copy",
        action="store_true",
        help="recompute partially matching blocks instead of copying them",
    )
    rp.add_argument(
        "--jobs", type=cli_args.positive_int, help="processes for a sweep (default: CPUs)"
    )
    rp.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where a sweep's points run: local processes (default) or Ray tasks",
    )
    rp.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="Ray cluster for --executor ray: auto, ray://host:port (default: a local instance)",
    )
    rp.add_argument(
        "--no-upper-bound",
        action="store_true",
        help="skip the infinite-cache upper bound, whose memory grows with the trace's unique "
        "blocks (misses are then not split into cold and capacity)",
    )
    rp.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    _serving_args(rp)
    _tier_args(rp)
    cli_args.add_trace_args(rp)
    return rp


def _serving_args(rp: argparse.ArgumentParser) -> None:
    serving = rp.add_argument_group("serving mode")
    serving.add_argument(
        "--gpu",
        default="h100-sxm",
        help=f"GPU of the cost model: {', '.join(gpu_names())}; with --model it also prices "
        "the GPU time saved (h100-sxm)",
    )
    serving.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="GPU profile JSON (written by prefixcache calibrate): its peak figures and fitted "
        "efficiencies replace --gpu's",
    )
    serving.add_argument(
        "--tp",
        type=cli_args.positive_int,
        default=1,
        help="tensor-parallel GPUs per replica: weights and KV split over them, compute and "
        "bandwidth multiplied, communication not modelled (1)",
    )
    serving.add_argument(
        "--token-budget", type=cli_args.positive_int, default=8192, help="tokens per step (8192)"
    )
    serving.add_argument(
        "--max-seqs", type=cli_args.positive_int, default=256, help="running sequences (256)"
    )
    serving.add_argument(
        "--rate-scale",
        type=cli_args.positive_float,
        default=1.0,
        help="replay arrivals this many times as fast (2: twice the request rate) to find the "
        "load the GPU sustains (1)",
    )
    serving.add_argument(
        "--time-scale",
        type=cli_args.positive_float,
        default=1.0,
        help="multiply every arrival time (2: the trace stretched to twice its span) (1)",
    )
    fleet = rp.add_argument_group("fleet (serving mode)")
    fleet.add_argument(
        "--replicas",
        type=cli_args.replica_list,
        metavar="N",
        help="replicas, each with the cache size above, behind the fleet router, e.g. 1,2,4",
    )
    fleet.add_argument(
        "--routing",
        type=cli_args.routing_list,
        metavar="POLICY",
        help=f"routing policies: {', '.join(sorted(ROUTING_POLICIES))} ({DEFAULT_POLICY})",
    )


def _tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "memory tiers (need --model)",
        "Below the GPU cache: a host-memory tier per replica and one pool shared by all "
        "replicas; blocks are loaded back when copying them beats recomputing them. A comma "
        "list sweeps the tier's size (0: no such tier).",
    )
    for tier, memory, bandwidth in (
        (
            "host",
            "host memory for KV per replica, e.g. 64GiB or 0,64GiB,256GiB (none)",
            "host <-> GPU bytes per second, per direction (55GB: PCIe Gen5 x16)",
        ),
        (
            "pool",
            "one KV pool shared by all replicas (a disaggregated store), e.g. 1TiB (none)",
            "pool <-> GPU bytes per second (25GB: one 200 Gb/s RDMA NIC)",
        ),
    ):
        g.add_argument(f"--{tier}-memory", type=cli_args.size_list, metavar="SIZE", help=memory)
        g.add_argument(
            f"--{tier}-bw", type=cli_args.bandwidth, metavar="BYTES_PER_S", help=bandwidth
        )
    g.add_argument(
        "--pool-write",
        choices=POOL_WRITE_POLICIES,
        help="when a block enters the pool: when a replica evicts it (evict, the default) or "
        "as soon as it is computed (through, as Mooncake's store is fed)",
    )


def sweep_configs(args: argparse.Namespace) -> list[ReplayConfig]:
    """One config per sweep point (the product of every comma list), the primary run first;
    ConfigError for options that do not go together or points that would run twice."""
    if args.blocks and args.kv_memory:
        raise ConfigError("give --blocks or --kv-memory, not both")
    for flag in (
        "blocks", "kv_memory", "block_size", "policy", "replicas", "routing", "host_memory",
        "pool_memory",
    ):  # fmt: skip
        values = getattr(args, flag, None) or []
        twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if twice is not None:  # the point would run twice and show up twice
            raise ConfigError(f"--{flag.replace('_', '-')}: {twice} is given twice")
    sizes: list[dict[str, int]] = (
        [{"capacity_blocks": b} for b in args.blocks]
        if args.blocks
        else [{"kv_memory": m} for m in args.kv_memory]
        if args.kv_memory
        else [{}]
    )
    base = ReplayConfig(
        model=args.model,
        mode=args.mode,
        seed=args.seed,
        hash_algo=args.hash_algo,
        partial_copy=not args.no_partial_copy,
        gpu=args.gpu,
        gpu_profile=args.gpu_profile,
        token_budget=args.token_budget,
        max_seqs=args.max_seqs,
        tp=args.tp,
        rate_scale=args.rate_scale,
        time_scale=args.time_scale,
        host_bw=DEFAULT_HOST_BANDWIDTH if args.host_bw is None else args.host_bw,
        pool_bw=DEFAULT_POOL_BANDWIDTH if args.pool_bw is None else args.pool_bw,
        pool_write=DEFAULT_POOL_WRITE if args.pool_write is None else args.pool_write,
        **cli_args.trace_settings(args),
        upper_bound=not args.no_upper_bound,
        shares=None if args.shares is None else parse_shares(args.shares),
    )
    tiers: list[dict[str, Any]] = [
        {"host_memory": host, "pool_memory": pool}
        for host in (args.host_memory or [None])
        for pool in (args.pool_memory or [None])
    ]
    fleets: list[dict[str, Any]] = [
        {"replicas": n, "routing": routing}
        for n in (args.replicas or [1])
        for routing in (args.routing or [None])
    ]
    if (args.replicas or args.routing) and args.mode != "serving":
        raise ConfigError("--replicas and --routing need --mode serving")
    tiered = any(args.host_memory or []) or any(args.pool_memory or [])  # at any sweep point
    if args.mode != "serving" and args.gpu != ReplayConfig().gpu and not tiered and not args.model:
        raise ConfigError(
            "--gpu needs --model (it prices the GPU time the hits saved), --mode serving, or a "
            "memory tier (whose load-or-recompute rule prices recompute on it)"
        )
    for flag, bandwidth, memory in (
        ("host", args.host_bw, args.host_memory),
        ("pool", args.pool_bw, args.pool_memory),
    ):
        if bandwidth is not None and not any(memory or []):
            raise ConfigError(
                f"--{flag}-bw needs --{flag}-memory: without the tier it does nothing"
            )
    if args.pool_write is not None and not any(args.pool_memory or []):
        raise ConfigError("--pool-write needs --pool-memory: without the pool it does nothing")
    configs = [
        base.with_(block_size=bs, policy=pol, **size, **fleet, **tier)
        for size, bs, pol, fleet, tier in itertools.product(
            sizes, args.block_size or [default_block_size(args)], args.policy, fleets, tiers
        )
    ]
    if len(configs) > 1 and (args.kv_memory or args.host_memory or args.pool_memory):
        _refuse_same_points(configs)
    return configs


def _refuse_same_points(configs: list[ReplayConfig]) -> None:
    """ConfigError when two memory sizes give the same cache in blocks: the point would run
    twice and show up twice."""
    seen: dict[tuple[Any, ...], ReplayConfig] = {}
    for config in configs:
        r = config.resolve()
        key = (
            r.capacity_blocks,
            None if r.tiers is None else (r.tiers.host_blocks, r.tiers.pool_blocks),
            config.with_(kv_memory=None, host_memory=None, pool_memory=None),
        )
        other = seen.setdefault(key, config)
        if other is not config:
            tiers = "" if r.tiers is None else f", host {r.tiers.host_blocks:,}"
            tiers += "" if r.tiers is None else f", pool {r.tiers.pool_blocks:,}"
            raise ConfigError(
                "two sweep points give the same cache: "
                f"{_memory_label(other)} and {_memory_label(config)} "
                f"({r.capacity_blocks:,} blocks{tiers}): keep one of them"
            )


def _memory_label(config: ReplayConfig) -> str:
    parts = [
        f"{flag} {value}"
        for flag, value in (
            ("--kv-memory", config.kv_memory),
            ("--host-memory", config.host_memory),
            ("--pool-memory", config.pool_memory),
        )
        if value is not None
    ]
    return ", ".join(parts) or "the default size"


def default_block_size(args: argparse.Namespace) -> int:
    """The trace's own block size for a Mooncake trace (its hash ids cover that many tokens),
    16 for everything else."""
    from prefixcache.replay.workload.scenario import is_scenario_path
    from prefixcache.replay.workload.traces import detect_format

    path = Path(args.source)
    if not path.is_file() or is_scenario_path(path):
        return 16
    kind = args.trace_format or detect_format(path, args.max_line_bytes)
    return int(args.trace_block_size) if kind == "mooncake" else 16
