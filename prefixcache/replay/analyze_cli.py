"""``prefixcache analyze``: statistics of a trace or scenario read once, and the hit rate of an
infinite cache per block size."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prefixcache.replay import cli_args
from prefixcache.replay.model_specs import get_model
from prefixcache.replay.run_config import ReplayConfig


def register(subparsers: Any) -> None:
    """Add the ``analyze`` command."""
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
        type=cli_args.int_list,
        help="block sizes (default 16, plus the trace block size for Mooncake)",
    )
    ap.add_argument("--model", help="to size the working set in bytes")
    ap.add_argument("--seed", type=cli_args.seed, help="override the scenario's seed")
    ap.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="print the statistics as text (default) or JSON",
    )
    cli_args.add_trace_args(ap)
    ap.set_defaults(func=_analyze)


def _analyze(args: argparse.Namespace) -> int:
    from prefixcache.replay.analyze import analyze_source, format_analysis
    from prefixcache.replay.workload.sources import check_block_size, open_source

    config = ReplayConfig(seed=args.seed, **cli_args.trace_settings(args))
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
    if args.format == "json":
        print(json.dumps(analysis, indent=2))
    else:
        print(format_analysis(analysis))
    return 0
