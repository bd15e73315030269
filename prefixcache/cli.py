"""Command line: ``prefixcache <command>`` (also ``python -m prefixcache``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Modules that add subcommands: each has ``register(subparsers)`` and sets ``func`` on its parsers.
COMMAND_MODULES = (
    "prefixcache.demo",
    "prefixcache.replay.replay_cli",
    "prefixcache.replay.analyze_cli",
    "prefixcache.replay.export_cli",
    "prefixcache.replay.calibrate.calibrate_cli",
    "prefixcache.report.report_cli",
    "prefixcache.fleet.service.serve_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="Prefix cache for LLM inference: demo, replay workloads, analyze traces, "
        "read hit-rate reports, and serve fleet routing.",
    )
    parser.add_argument(
        "--version", action="version", version=f"prefixcache {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    import prefixcache

    return str(prefixcache.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader stopped early (``| head``): not an error
        # what is still buffered for stdout goes nowhere, so exiting does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
