"""``prefixcache replay`` and ``prefixcache analyze``."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, PrefixCacheError
from prefixcache.eviction import POLICIES
from prefixcache.fleet.routing import POLICIES as ROUTING_POLICIES
from prefixcache.pool import UNBOUNDED
from prefixcache.replay.model_specs import get_model, gpu_names, model_names, parse_size
from prefixcache.replay.replay_config import MODES, ReplayConfig
from prefixcache.replay.sweep_executors import EXECUTORS
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
    rp.add_argument("source", metavar="SCENARIO_OR_TRACE")
    size = rp.add_argument_group("cache size (one of)")
    size.add_argument(
        "--blocks",
        type=_blocks_list,
        help="capacity in blocks, e.g. 1000,5859,10000; inf: a cache that never evicts",
    )
    size.add_argument(
        "--kv-memory", type=_size_list, metavar="SIZE", help="KV memory, e.g. 40GiB (needs --model)"
    )
    rp.add_argument("--block-size", type=_int_list, default=[16], help="tokens per block (16)")
    rp.add_argument(
        "--model",
        help=f"for bytes and FLOPs: {', '.join(model_names())}, or a "
        "JSON/YAML model file or Hugging Face config.json",
    )
    rp.add_argument(
        "--policy",
        type=_str_list,
        default=["lru"],
        help=f"eviction policy: {', '.join(sorted(POLICIES))} (lru)",
    )
    rp.add_argument("--mode", choices=MODES, default="sequential")
    rp.add_argument("--seed", type=int, help="override the scenario's seed / trace token seed")
    rp.add_argument("--out", type=Path, help="run directory (default runs/NAME-TIMESTAMP)")
    rp.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="stdout: a summary or report.json",
    )
    rp.add_argument("--hash-algo", default="xxh3_128")
    rp.add_argument(
        "--no-partial-copy",
        action="store_true",
        help="recompute partially matching blocks instead of copying them",
    )
    rp.add_argument("--jobs", type=int, help="processes for a sweep (default: CPUs)")
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
    serving.add_argument("--gpu", default="h100-sxm", help=f"{', '.join(gpu_names())}")
    serving.add_argument("--token-budget", type=int, default=8192, help="tokens per step (8192)")
    serving.add_argument("--max-seqs", type=int, default=256, help="running sequences (256)")
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
        help=f"routing policies: {', '.join(sorted(ROUTING_POLICIES))} (prefix_balanced)",
    )
    _trace_args(rp)
    rp.set_defaults(func=_replay)

    ap = subparsers.add_parser(
        "analyze",
        help="trace or scenario statistics and the infinite-cache upper bound",
        description="Stream a trace or scenario once: request, token and arrival statistics, "
        "and the hit rate of an infinite cache per block size.",
    )
    ap.add_argument("source", metavar="TRACE_OR_SCENARIO")
    ap.add_argument(
        "--block-size",
        type=_int_list,
        help="block sizes (default 16, plus the trace block size for Mooncake)",
    )
    ap.add_argument("--model", help="to size the working set in bytes")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--format", choices=("text", "json"), default="text")
    _trace_args(ap)
    ap.set_defaults(func=_analyze)


def _trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traces")
    g.add_argument("--trace-format", choices=FORMATS, help="default: detected from the file")
    g.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per Mooncake hash id (512)"
    )
    g.add_argument("--tokenizer", help="tokenizer.json for text prompts (default: bytes)")
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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def _blocks_list(text: str) -> list[int]:
    """Capacities in blocks; ``inf`` is an unbounded cache."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    finite = ",".join(x for x in parts if x.lower() != "inf")
    values = _int_list(finite) if finite else []
    return [UNBOUNDED if x.lower() == "inf" else values.pop(0) for x in parts] or _int_list(text)


def _replica_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected replica counts separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive replica counts: {text!r}")
    return values


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
        token_budget=args.token_budget,
        max_seqs=args.max_seqs,
        trace_format=args.trace_format,
        trace_block_size=args.trace_block_size,
        tokenizer=args.tokenizer,
        output_len=args.output_len,
        max_line_bytes=args.max_line_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        upper_bound=not args.no_upper_bound,
    )
    fleets: list[dict[str, Any]] = [
        {"replicas": n, "routing": routing}
        for n in (args.replicas or [1])
        for routing in (args.routing or [None])
    ]
    if (args.replicas or args.routing) and args.mode != "serving":
        raise ConfigError("--replicas and --routing need --mode serving")
    return [
        base.with_(block_size=bs, policy=pol, **size, **fleet)
        for size, bs, pol, fleet in itertools.product(sizes, args.block_size, args.policy, fleets)
    ]


def _replay(args: argparse.Namespace) -> int:
    from prefixcache.replay.replay_result import default_run_dir, write_run
    from prefixcache.replay.runner import replay_sweep
    from prefixcache.report.text_formats import format_summary

    try:
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
    except PrefixCacheError as exc:
        print(f"prefixcache replay: error: {exc}", file=sys.stderr)
        return 2
    _render_rich_report(out)
    if args.format == "json":
        print(json.dumps(report, indent=2))
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(format_summary(report, str(out)))
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
        config = ReplayConfig(
            seed=args.seed,
            trace_format=args.trace_format,
            trace_block_size=args.trace_block_size,
            tokenizer=args.tokenizer,
            output_len=args.output_len,
            max_line_bytes=args.max_line_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
        )
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
