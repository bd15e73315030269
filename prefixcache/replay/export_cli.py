"""``prefixcache export``: write a scenario's or trace's requests as a Mooncake trace or OpenAI
batch JSONL, for real serving benchmarks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.replay import cli_args
from prefixcache.replay.run_config import ReplayConfig
from prefixcache.replay.workload.export import FORMATS


def register(subparsers: Any) -> None:
    """Add the ``export`` command."""
    ep = subparsers.add_parser(
        "export",
        help="write a scenario's or trace's requests as a Mooncake trace or OpenAI batch JSONL",
        description="Write the requests a replay would see in a format real serving benchmarks "
        "read: a Mooncake trace (timestamp, input_length, output_length, hash_ids) for "
        "trace-replay benchmarks, or OpenAI batch JSONL of /v1/completions requests with "
        "token-id prompts (vLLM run_batch).",
    )
    ep.add_argument("source", metavar="SCENARIO_OR_TRACE", help="scenario or trace file to export")
    ep.add_argument("--format", choices=FORMATS, required=True, help="output format")
    ep.add_argument("--out", type=Path, help="output file (default: stdout)")
    ep.add_argument("--seed", type=cli_args.seed, help="override the scenario's seed")
    ep.add_argument(
        "--block-size",
        type=cli_args.positive_int,
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
        type=cli_args.positive_int,
        default=32000,
        help="OpenAI requests: token ids are taken modulo this, the served model's vocabulary "
        "size (32000)",
    )
    cli_args.add_trace_args(ep)
    ep.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from prefixcache.atomic_files import atomic_open
    from prefixcache.replay.workload.export import mooncake_lines, openai_lines
    from prefixcache.replay.workload.sources import open_source

    try:
        if args.block_size < 1 or args.vocab_size < 1:
            raise ConfigError("--block-size and --vocab-size must be positive integers")
        config = ReplayConfig(seed=args.seed, **cli_args.trace_settings(args))
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
    except OSError as exc:
        print(f"prefixcache export: error: {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0
