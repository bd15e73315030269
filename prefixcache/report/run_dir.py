"""A replay's run directory, loaded: report.json plus the per-request and timeline CSV files."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.errors import PrefixCacheError
from prefixcache.report.schema import validate_report
from prefixcache.run_format import REQUEST_COLUMNS, TIMELINE_COLUMNS

_TEXT_COLUMNS = frozenset({"request_id", "namespace"})

Columns = dict[str, np.ndarray]


class RunDirError(PrefixCacheError, ValueError):
    """The run directory is missing a file or a file is malformed."""


@dataclass(frozen=True)
class Run:
    path: Path
    report: dict[str, Any]  # report.json, validated
    requests: Columns  # requests.csv by column; empty cells of numeric columns are NaN
    timeline: Columns  # timeline.csv by column

    @property
    def num_requests(self) -> int:
        return len(self.requests["prompt_tokens"])


def _numeric(name: str, cells: tuple[str, ...], source: Path) -> np.ndarray:
    try:
        values = np.array(cells).astype(np.float64)  # fast path: no empty cells
    except ValueError:
        try:
            values = np.array([float(c) if c.strip() else np.nan for c in cells])
        except ValueError as exc:
            raise RunDirError(f"{source}: column {name!r} is not numeric ({exc})") from None
    finite = values[np.isfinite(values)]
    if len(finite) == len(values) and np.all(finite == np.round(finite)):
        return values.astype(np.int64)  # counters stay exact integers
    return values


def read_columns(path: Path, required: tuple[str, ...]) -> Columns:
    """Read a CSV file into one array per column; text columns stay strings."""
    if not path.is_file():
        raise RunDirError(f"{path} not found")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = list(reader)
    if header is None:
        raise RunDirError(f"{path} is empty (no header)")
    missing = [c for c in required if c not in header]
    if missing:
        raise RunDirError(f"{path} lacks column(s) {', '.join(missing)}")
    bad = next((i for i, r in enumerate(rows) if len(r) != len(header)), None)
    if bad is not None:
        raise RunDirError(
            f"{path} row {bad + 2} has {len(rows[bad])} cells, header has {len(header)}"
        )
    cells = list(zip(*rows, strict=True)) if rows else [() for _ in header]
    return {
        name: np.array(col, dtype=str) if name in _TEXT_COLUMNS else _numeric(name, col, path)
        for name, col in zip(header, cells, strict=True)
    }


def load_run(run_dir: str | Path) -> Run:
    """Load and validate a run directory written by ``prefixcache replay``."""
    path = Path(run_dir)
    report_path = path / "report.json"
    if not report_path.is_file():
        raise RunDirError(f"{report_path} not found; is {path} a run directory?")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{report_path} is not valid JSON: {exc}") from None
    validate_report(report)
    requests = read_columns(path / "requests.csv", REQUEST_COLUMNS)
    timeline = read_columns(path / "timeline.csv", TIMELINE_COLUMNS)
    return Run(path=path, report=report, requests=requests, timeline=timeline)
