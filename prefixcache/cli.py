"""Command line: ``prefixcache <command>`` (also ``python -m prefixcache``)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from prefixcache.errors import PrefixCacheError

_NEGATIVE_VALUE = re.compile(r"^-\.?\d")  # -1GiB, -1e-3, -.5: values, never option names
EXIT_INTERRUPTED = 130  # as a shell reports a command that SIGINT (Ctrl-C) ended
EXIT_ERROR = 2  # bad input or a failed run, said in one line

# Modules that add subcommands: each has ``register(subparsers)`` and sets ``func`` on its parsers.
# A ``PrefixCacheError`` or ``OSError`` out of ``func`` is reported here; a command catches only
# what it words otherwise.
COMMAND_MODULES = (
    "prefixcache.demo",
    "prefixcache.replay.run_cli",
    "prefixcache.replay.analyze_cli",
    "prefixcache.replay.export_cli",
    "prefixcache.replay.calibrate.measure_cli",
    "prefixcache.report.print_cli",
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
    for command in sub.choices.values():
        # "--kv-memory -1GiB" is a value, not an unknown option: the option's own check says
        # what is wrong with it (argparse only takes plain numbers such as -1 as values)
        command._negative_number_matcher = _NEGATIVE_VALUE
    return parser


def _version() -> str:
    import prefixcache

    return f"{prefixcache.__version__} (core: {prefixcache.CORE_BUILD.reason})"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands load
        print("prefixcache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print(f"prefixcache {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader stopped early (``| head``): not an error
        # what is still buffered for stdout goes nowhere, so exiting does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (PrefixCacheError, OSError) as exc:  # bad input, a file, a failed run: one line
        print(f"prefixcache {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
