"""``prefixcache report`` and ``prefixcache compare``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefixcache.atomic_files import write_text_atomic
from prefixcache.report.checks import consistency_checks
from prefixcache.report.compare import compare_document
from prefixcache.report.render.html import render_html
from prefixcache.report.render.text_formats import render_markdown, render_terminal
from prefixcache.report.run_dir import load_run
from prefixcache.report.sections import build_document

EXIT_INCONSISTENT = 1  # the report was printed, but report.json disagrees with its CSV files
# no report (the run directory is missing, unreadable or not a valid run): cli.main says why, 2


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    print(f"wrote {path}", file=sys.stderr)


def report_command(args: argparse.Namespace) -> int:
    run = load_run(args.run_dir)
    doc = build_document(run)
    if args.json:
        print(json.dumps(run.report, indent=2, sort_keys=True))
    elif not args.quiet:
        print(render_terminal(doc, definitions=not args.no_definitions))
    if args.md is not None:
        _write(args.md, render_markdown(doc))
    if args.html is not None:
        _write(args.html, render_html(doc, run))
    failed = [c for c in consistency_checks(run) if not c.ok]
    if failed:
        print(
            f"prefixcache report: error: {len(failed)} consistency check(s) failed, first: "
            f"{failed[0].name} ({failed[0].detail})",
            file=sys.stderr,
        )
        return EXIT_INCONSISTENT
    return 0


def compare_command(args: argparse.Namespace) -> int:
    doc = compare_document(load_run(args.run_a), load_run(args.run_b))
    print(render_terminal(doc, definitions=not args.no_definitions))
    if args.md is not None:
        _write(args.md, render_markdown(doc))
    return 0


def register(subparsers: Any) -> None:
    report = subparsers.add_parser(
        "report",
        help="print a run's hit-rate and savings report; write it as HTML or Markdown",
        description="Read a run directory written by 'prefixcache replay' (report.json, "
        "requests.csv, timeline.csv), check it, and print its report.",
    )
    report.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="run directory written by 'prefixcache replay'",
    )
    report.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="write the self-contained HTML page (plots need matplotlib)",
    )
    report.add_argument("--md", type=Path, metavar="FILE", help="write the Markdown report")
    report.add_argument(
        "--json", action="store_true", help="print the validated report.json instead of the summary"
    )
    report.add_argument("--quiet", action="store_true", help="print nothing to stdout")
    report.add_argument(
        "--no-definitions",
        action="store_true",
        help="leave the definitions out of the terminal summary",
    )
    report.set_defaults(func=report_command)

    compare = subparsers.add_parser(
        "compare",
        help="compare two runs: setup differences and the change of every figure",
        description="Show what differs between two run directories and how each figure moved "
        "from RUN_A to RUN_B.",
    )
    compare.add_argument("run_a", type=Path, metavar="RUN_A", help="the run compared against")
    compare.add_argument(
        "run_b", type=Path, metavar="RUN_B", help="the run whose changes are shown"
    )
    compare.add_argument("--md", type=Path, metavar="FILE", help="also write it as Markdown")
    compare.add_argument("--no-definitions", action="store_true", help="leave the definitions out")
    compare.set_defaults(func=compare_command)
