"""``prefixcache replay``: run a replay or a sweep, write its run directory, print the result."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, MissingDependencyError
from prefixcache.replay.run_options import add_replay_parser, sweep_configs

EXIT_STRICT = 3  # --strict: the run finished but some requests were rejected, or it overloaded
EXIT_INTERRUPTED = 130


def register(subparsers: Any) -> None:
    """Add the ``replay`` command."""
    add_replay_parser(subparsers).set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    from prefixcache.replay.run_result import check_run_dir, default_run_dir, write_run
    from prefixcache.replay.runner import replay_sweep
    from prefixcache.report.render.text_formats import format_summary
    from prefixcache.report.run_warnings import run_warnings

    try:
        if args.out is not None:
            check_run_dir(args.out)  # before the replay, not after it
            if not args.force and _holds_files(args.out):
                raise ConfigError(
                    f"--out {args.out}: the directory holds files already (an earlier run?); "
                    "give another --out, or --force to replace the run there"
                )
        result = replay_sweep(
            args.source,
            sweep_configs(args),
            jobs=args.jobs,
            progress=args.progress,
            executor=args.executor,
            ray_address=args.ray_address,
        )
        report = result.to_report_dict()
        out = write_run(result, args.out or default_run_dir(result.name), report)
        _render_rich_report(out)
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


def _holds_files(path: Path) -> bool:
    """Whether ``path`` is a directory with anything in it."""
    try:
        return path.is_dir() and next(path.iterdir(), None) is not None
    except OSError as exc:
        raise ConfigError(f"--out {path}: {exc.strerror or exc}") from None


def _render_rich_report(run_dir: Path) -> None:
    """The HTML/Markdown report, when prefixcache.report (and what it needs) is installed."""
    try:
        from prefixcache.report import render_all

        render_all(run_dir)
    except MissingDependencyError as exc:  # the rest is written; its message says the fix
        print(f"note: report.html not written: {exc}", file=sys.stderr)
    except ImportError as exc:  # report.json and the CSVs are written; say what is missing
        print(
            f"note: rich report not written ({exc}); "
            "install the 'report' extra: pip install 'prefixcache[report]'",
            file=sys.stderr,
        )
