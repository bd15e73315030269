"""``prefixcache replay`` and ``prefixcache analyze``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, PrefixCacheError
from prefixcache.eviction import POLICIES
from prefixcache.fleet.routing import DEFAULT_POLICY
from prefixcache.fleet.routing import POLICIES as ROUTING_POLICIES
from prefixcache.hashing import HASH_FUNCTIONS
from prefixcache.pool import UNBOUNDED
from prefixcache.replay.model_specs import get_model, gpu_names, model_names, parse_size
from prefixcache.replay.replay_config import MODES, ReplayConfig
from prefixcache.replay.sweep_executors import EXECUTORS
from prefixcache.replay.tier_settings import DEFAULT_HOST_BANDWIDTH, DEFAULT_POOL_BANDWIDTH
from prefixcache.replay.traces import FORMATS, MAX_LINE_BYTES, MAX_PROMPT_TOKENS


def register(subparsers: Any) -> None:
    rp = subparsers.add_parser(
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
        type=_blocks_list,
        help="capacity in blocks, e.g. 1000,5859,10000; inf: a cache that never evicts",
    )
    size.add_argument(
        "--kv-memory",
        type=_size_list,
        metavar="SIZE",
        help="KV memory, e.g. 40GiB (needs --model in sequential mode; serving mode "
        "assumes llama-3.1-8b without one)",
    )
    rp.add_argument(
        "--block-size",
        type=_int_list,
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
        type=_str_list,
        default=["lru"],
        help=f"eviction policy: {', '.join(sorted(POLICIES))} (lru)",
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
        type=_seed,
        help="override the scenario's seed / trace token seed (a non-negative integer)",
    )
    rp.add_argument("--out", type=Path, help="run directory (default runs/NAME-TIMESTAMP)")
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
    rp.add_argument("--jobs", type=_positive_int, help="processes for a sweep (default: CPUs)")
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
    serving = rp.add_argument_group("serving mode")
    serving.add_argument(
        "--gpu", default="h100-sxm", help=f"GPU of the cost model: {', '.join(gpu_names())}"
    )
    serving.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="GPU profile JSON (written by prefixcache calibrate): its peak figures and fitted "
        "efficiencies replace --gpu's",
    )
    serving.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel GPUs per replica: weights and KV split over them, compute and "
        "bandwidth multiplied, communication not modelled (1)",
    )
    serving.add_argument("--token-budget", type=int, default=8192, help="tokens per step (8192)")
    serving.add_argument("--max-seqs", type=int, default=256, help="running sequences (256)")
    serving.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="replay arrivals this many times as fast (2: twice the request rate) to find the "
        "load the GPU sustains (1)",
    )
    serving.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every arrival time (2: the trace stretched to twice its span) (1)",
    )
    fleet = rp.add_argument_group("fleet (serving mode)")
    fleet.add_argument(
        "--replicas",
        type=_replica_list,
        metavar="N",
        help="replicas, each with the cache size above, behind the fleet router, e.g. 1,2,4",
    )
    fleet.add_argument(
        "--routing",
        type=_routing_list,
        metavar="POLICY",
        help=f"routing policies: {', '.join(sorted(ROUTING_POLICIES))} ({DEFAULT_POLICY})",
    )
    _tier_args(rp)
    _trace_args(rp)
    rp.set_defaults(func=_replay)

    ap = subparsers.add_parser(
        "analyze",
        help="trace or scenario statistics and the infinite-cache whole-block hit rate",
        description="Stream a trace or scenario once: request, token and arrival statistics, "
        "and the hit rate of an infinite cache per block size, counting whole blocks only (a "
        "replay with partial-block copies can exceed it).",
    )
    ap.add_argument(
        "source", metavar="TRACE_OR_SCENARIO", help="trace or scenario file to read once"
    )
    ap.add_argument(
        "--block-size",
        type=_int_list,
        help="block sizes (default 16, plus the trace block size for Mooncake)",
    )
    ap.add_argument("--model", help="to size the working set in bytes")
    ap.add_argument("--seed", type=int, help="override the scenario's seed")
    ap.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="print the statistics as text (default) or JSON",
    )
    _trace_args(ap)
    ap.set_defaults(func=_analyze)
    _register_export(subparsers)


def _register_export(subparsers: Any) -> None:
    from prefixcache.replay.export import FORMATS as EXPORT_FORMATS

    ep = subparsers.add_parser(
        "export",
        help="write a scenario's or trace's requests as a Mooncake trace or OpenAI batch JSONL",
        description="Write the requests a replay would see in a format real serving benchmarks "
        "read: a Mooncake trace (timestamp, input_length, output_length, hash_ids) for "
        "trace-replay benchmarks, or OpenAI batch JSONL of /v1/completions requests with "
        "token-id prompts (vLLM run_batch).",
    )
    ep.add_argument("source", metavar="SCENARIO_OR_TRACE", help="scenario or trace file to export")
    ep.add_argument("--format", choices=EXPORT_FORMATS, required=True, help="output format")
    ep.add_argument("--out", type=Path, help="output file (default: stdout)")
    ep.add_argument("--seed", type=_seed, help="override the scenario's seed")
    ep.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="tokens per Mooncake hash id (512, as in the Mooncake traces)",
    )
    ep.add_argument(
        "--model-name",
        default="default",
        help='the model field of OpenAI requests (default: "default")',
    )
    ep.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="OpenAI requests: token ids are taken modulo this, the served model's vocabulary "
        "size (32000)",
    )
    _trace_args(ep)
    ep.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from prefixcache.atomic_files import atomic_open
    from prefixcache.replay.export import mooncake_lines, openai_lines
    from prefixcache.replay.sources import open_source

    try:
        if args.block_size < 1 or args.vocab_size < 1:
            raise ConfigError("--block-size and --vocab-size must be positive integers")
        config = ReplayConfig(seed=args.seed, **_trace_settings(args))
        source = open_source(args.source, config.with_(block_size=1))
        if args.format == "mooncake":
            lines = mooncake_lines(source, args.block_size)
        else:
            lines = openai_lines(source, args.model_name, args.vocab_size)
        if args.out is None:
            try:
                for line in lines:
                    print(line)
                sys.stdout.flush()
            except BrokenPipeError:  # the reader stopped early (| head): not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        else:
            with atomic_open(args.out) as f:
                for line in lines:
                    f.write(line + "\n")
            print(f"wrote {args.out}", file=sys.stderr)
    except PrefixCacheError as exc:
        print(f"prefixcache export: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"prefixcache export: error: {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


def _tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "memory tiers (need --model)",
        "Below the GPU cache: a host-memory tier per replica and one pool shared by all "
        "replicas; blocks are loaded back when copying them beats recomputing them. A comma "
        "list sweeps the tier's size (0: no such tier).",
    )
    g.add_argument(
        "--host-memory",
        type=_size_list,
        metavar="SIZE",
        help="host memory for KV per replica, e.g. 64GiB or 0,64GiB,256GiB (none)",
    )
    g.add_argument(
        "--host-bw",
        type=_bandwidth,
        metavar="BYTES_PER_S",
        help="host <-> GPU bytes per second, per direction (55GB: PCIe Gen5 x16)",
    )
    g.add_argument(
        "--pool-memory",
        type=_size_list,
        metavar="SIZE",
        help="one KV pool shared by all replicas (a disaggregated store), e.g. 1TiB (none)",
    )
    g.add_argument(
        "--pool-bw",
        type=_bandwidth,
        metavar="BYTES_PER_S",
        help="pool <-> GPU bytes per second (25GB: one 200 Gb/s RDMA NIC)",
    )


def _bandwidth(text: str) -> float:
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot read bandwidth {text!r}; write bytes per second, e.g. 55GB or 25GB"
        ) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be positive, got {text!r}")
    return float(value)


def _trace_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ReplayConfig`` fields that ``_trace_args`` options set."""
    return {
        "trace_format": args.trace_format,
        "trace_block_size": args.trace_block_size,
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "output_len": args.output_len,
        "max_line_bytes": args.max_line_bytes,
        "max_prompt_tokens": args.max_prompt_tokens,
    }


def _trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traces")
    g.add_argument("--trace-format", choices=FORMATS, help="default: detected from the file")
    g.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per Mooncake hash id (512)"
    )
    g.add_argument("--tokenizer", help="tokenizer.json for text prompts (default: bytes)")
    g.add_argument(
        "--chat-template",
        help="the model's tokenizer_config.json or a .jinja file: chat lines (messages) are "
        "rendered as the engine renders them (default: a neutral rendering)",
    )
    g.add_argument(
        "--output-len", type=int, default=128, help="output tokens for lines that give none (128)"
    )
    g.add_argument(
        "--max-line-bytes",
        type=_positive,
        default=MAX_LINE_BYTES,
        help=f"reject longer trace lines ({MAX_LINE_BYTES:,})",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        default=MAX_PROMPT_TOKENS,
        help=f"reject longer trace prompts ({MAX_PROMPT_TOKENS:,})",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer: {text!r}")
    return value


def _int_list(text: str, what: str = "integers") -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} separated by commas: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive {what}: {text!r}")
    return values


def _blocks_list(text: str) -> list[int]:
    """Capacities in blocks; ``inf`` is an unbounded cache."""
    parts = _str_list(text)
    if not parts:
        return _int_list(text)  # raises: nothing given
    numbers = [x for x in parts if x.lower() != "inf"]
    finite = iter(_int_list(",".join(numbers), "block counts (or inf)") if numbers else [])
    return [UNBOUNDED if x.lower() == "inf" else next(finite) for x in parts]


def _replica_list(text: str) -> list[int]:
    return _int_list(text, "replica counts")


def _routing_list(text: str) -> list[str]:
    values = _str_list(text)
    unknown = [v for v in values if v not in ROUTING_POLICIES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown routing policy {(unknown or [text])[0]!r}; choose from "
            f"{', '.join(sorted(ROUTING_POLICIES))}"
        )
    return values


def _size_list(text: str) -> list[int]:
    try:
        return [parse_size(x) for x in text.split(",") if x.strip()]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _configs(args: argparse.Namespace) -> list[ReplayConfig]:
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
        **_trace_settings(args),
        upper_bound=not args.no_upper_bound,
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
    if args.mode != "serving" and args.gpu != ReplayConfig().gpu and not tiered:
        raise ConfigError(
            "--gpu needs --mode serving (or a memory tier, whose load-or-recompute rule prices "
            "recompute on it)"
        )
    for flag, bandwidth, memory in (
        ("host", args.host_bw, args.host_memory),
        ("pool", args.pool_bw, args.pool_memory),
    ):
        if bandwidth is not None and not any(memory or []):
            raise ConfigError(
                f"--{flag}-bw needs --{flag}-memory: without the tier it does nothing"
            )
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
    from prefixcache.replay.scenario import is_scenario_path
    from prefixcache.replay.traces import detect_format

    path = Path(args.source)
    if not path.is_file() or is_scenario_path(path):
        return 16
    kind = args.trace_format or detect_format(path, args.max_line_bytes)
    return int(args.trace_block_size) if kind == "mooncake" else 16


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else "expected {what}: 'text'"."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}: {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_seed = _int_at_least(0, "a non-negative integer")


EXIT_STRICT = 3  # --strict: the run finished but some requests were rejected, or it overloaded
EXIT_INTERRUPTED = 130


def _replay(args: argparse.Namespace) -> int:
    from prefixcache.replay.replay_result import check_run_dir, default_run_dir, write_run
    from prefixcache.replay.runner import replay_sweep
    from prefixcache.report.run_warnings import run_warnings
    from prefixcache.report.text_formats import format_summary

    try:
        if args.out is not None:
            check_run_dir(args.out)  # before the replay, not after it
        result = replay_sweep(
            args.source,
            _configs(args),
            jobs=args.jobs,
            progress=args.progress,
            executor=args.executor,
            ray_address=args.ray_address,
        )
        report = result.to_report_dict()
        out = write_run(result, args.out or default_run_dir(result.name), report)
        _render_rich_report(out)
    except PrefixCacheError as exc:
        print(f"prefixcache replay: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prefixcache replay: interrupted; no run written", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.format == "json":
        print(json.dumps(report, indent=2))
        print(f"wrote {out}", file=sys.stderr)
        for warning in run_warnings(report):
            print(f"warning: {warning}", file=sys.stderr)
    else:
        print(format_summary(report, str(out)))
    serving = report.get("serving") or {}
    points = report.get("sweep") or []  # every point of a sweep counts, not just the first
    if args.strict and (
        report["rejected_requests"]
        or (serving.get("load") or {}).get("overloaded")
        or any(p.get("rejected_requests") or p.get("overloaded") for p in points)
    ):
        return EXIT_STRICT
    return 0


def _render_rich_report(run_dir: Path) -> None:
    """The HTML/Markdown report, when prefixcache.report (and what it needs) is installed."""
    try:
        from prefixcache.report import render_all

        render_all(run_dir)
    except ImportError as exc:  # report.json and the CSVs are written; say what is missing
        print(
            f"note: rich report not written ({exc}); "
            "install the 'report' extra: pip install 'prefixcache[report]'",
            file=sys.stderr,
        )


def _analyze(args: argparse.Namespace) -> int:
    from prefixcache.replay.analyze import analyze_source, format_analysis
    from prefixcache.replay.sources import check_block_size, open_source

    try:
        config = ReplayConfig(seed=args.seed, **_trace_settings(args))
        sizes = args.block_size
        if sizes is None:
            sizes = [16]
        source = open_source(args.source, config.with_(block_size=min(sizes)))
        if args.block_size is None and source.kind == "mooncake":
            sizes = sorted({16, args.trace_block_size})
        model = get_model(args.model) if args.model else None
        for p in sizes:
            check_block_size(source.kind, args.trace_block_size, p)
        analysis = analyze_source(source, sizes, model)
    except PrefixCacheError as exc:
        print(f"prefixcache analyze: error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(analysis, indent=2))
    else:
        print(format_analysis(analysis))
    return 0
