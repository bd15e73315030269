"""A replay's run directory, loaded: report.json plus the per-request and timeline CSV files.

requests.csv grows with the trace (a row per request), so it is read in one streaming pass, a
chunk of rows at a time: the sums the cross-checks need are added up as the chunks go by, and
only the columns the figures need are kept, as numpy arrays (prompt and hit tokens, TTFTs).

report.json is validated against ``schema.json`` by a small validator for the part of JSON Schema
the file uses (type, required, properties, items, enum, minimum, maximum, pattern), so reading a
report needs no extra dependency.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.errors import PrefixCacheError
from prefixcache.run_format import MISS_CAUSES, REQUEST_COLUMNS, SCHEMA_VERSION, TIMELINE_COLUMNS

_TEXT_COLUMNS = frozenset({"request_id", "namespace"})
KEPT_REQUEST_COLUMNS = ("prompt_tokens", "hit_tokens", "ttft_s", "ttft_nocache_s")
# every count column of requests.csv (not the ids, times or namespace)
SUMMED_REQUEST_COLUMNS = tuple(
    c
    for c in REQUEST_COLUMNS
    if c not in ("request_id", "arrival_s", "namespace", "ttft_s", "ttft_nocache_s")
)
_CHUNK_ROWS = 16_384

Columns = dict[str, np.ndarray]


class RunDirError(PrefixCacheError, ValueError):
    """The run directory is missing a file or a file is malformed."""


@dataclass(frozen=True)
class RequestTotals:
    """What requests.csv adds up to, gathered in the streaming pass."""

    rows: int
    sums: dict[str, int]  # per SUMMED_REQUEST_COLUMNS
    zero_hit_rows: int  # rows with no hit token
    rows_add_up: bool  # every row's misses add up to its prompt minus hit tokens


@dataclass(frozen=True)
class Run:
    path: Path
    report: dict[str, Any]  # report.json, validated
    requests: Columns  # KEPT_REQUEST_COLUMNS of requests.csv; empty numeric cells are NaN
    request_totals: RequestTotals
    timeline: Columns  # timeline.csv by column

    @property
    def num_requests(self) -> int:
        return self.request_totals.rows


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
        if np.all(np.abs(finite) < 2.0**53):  # exact in float64
            return values.astype(np.int64)  # counters stay exact integers
        try:  # larger (free blocks of unbounded caches): exact Python ints
            return np.array([int(c) for c in cells], dtype=object)
        except ValueError:
            pass
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


def _int_cells(name: str, cells: tuple[str, ...], source: Path) -> np.ndarray:
    try:
        return np.array(cells).astype(np.int64)
    except ValueError:
        values = _numeric(name, cells, source)
        if values.dtype != np.int64:
            raise RunDirError(f"{source}: column {name!r} holds a non-integer count") from None
        return values


def read_requests(path: Path) -> tuple[RequestTotals, Columns]:
    """Stream requests.csv once: its totals, and the columns the figures need."""
    if not path.is_file():
        raise RunDirError(f"{path} not found")
    sums = dict.fromkeys(SUMMED_REQUEST_COLUMNS, 0)
    kept: dict[str, list[np.ndarray]] = {c: [] for c in KEPT_REQUEST_COLUMNS}
    rows = zero_hit = 0
    add_up = True
    misses = [f"miss_{c}" for c in MISS_CAUSES]
    with path.open(newline="", encoding="utf-8") as f:
        header = next(csv.reader([f.readline()]), None)
        if header is None:
            raise RunDirError(f"{path} is empty (no header)")
        missing = [c for c in REQUEST_COLUMNS if c not in header]
        if missing:
            raise RunDirError(f"{path} lacks column(s) {', '.join(missing)}")
        chunks = _Chunks(path, header)
        while lines := list(itertools.islice(f, _CHUNK_ROWS)):
            counts, floats = chunks.parse(lines, rows)
            for c, values in counts.items():
                sums[c] += int(values.sum())
            hit = counts["hit_tokens"]
            zero_hit += int(np.count_nonzero(hit == 0))
            missed = sum(counts[c] for c in misses)
            add_up = add_up and bool(np.all(missed == counts["prompt_tokens"] - hit))
            for c in KEPT_REQUEST_COLUMNS:
                kept[c].append(counts[c] if c in counts else floats[c])
            rows += len(lines)
    columns = {
        c: np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
        for c, parts in kept.items()
    }
    return RequestTotals(rows, sums, zero_hit, add_up), columns


class _Chunks:
    """Parses chunks of requests.csv lines: numpy's C reader when every line is plain (no
    quotes, the header's number of cells), the csv module otherwise, which also names a bad row."""

    def __init__(self, path: Path, header: list[str]) -> None:
        self.path, self.header = path, header
        self.where = {name: k for k, name in enumerate(header)}
        self.int_cols = [self.where[c] for c in SUMMED_REQUEST_COLUMNS]
        self.float_names = [c for c in KEPT_REQUEST_COLUMNS if c not in SUMMED_REQUEST_COLUMNS]
        self.float_cols = [self.where[c] for c in self.float_names]
        n = len(header)
        self.floats_last = sorted(self.float_cols) == [n - 2, n - 1]  # as replay writes them

    def parse(self, lines: list[str], before: int) -> tuple[Columns, Columns]:
        """Count and float columns of ``lines``; ``before``: rows read before them."""
        commas = len(self.header) - 1
        if all(line.count(",") == commas and '"' not in line for line in lines):
            try:
                return self._fast(lines)
            except ValueError:
                pass  # a malformed cell: the csv path says which
        return self._slow(lines, before)

    def _fast(self, lines: list[str]) -> tuple[Columns, Columns]:
        ints = np.loadtxt(lines, delimiter=",", usecols=self.int_cols, dtype=np.int64, ndmin=2)
        counts = {c: ints[:, k] for k, c in enumerate(SUMMED_REQUEST_COLUMNS)}
        if self.floats_last and all(line.endswith(",,\n") for line in lines):
            # the serving columns are empty: not a serving run
            nan = np.full(len(lines), np.nan)
            return counts, {c: nan for c in self.float_names}
        floats = np.loadtxt(
            lines,
            delimiter=",",
            usecols=self.float_cols,
            dtype=np.float64,
            ndmin=2,
            converters=lambda cell: float(cell) if cell.strip() else np.nan,
        )
        return counts, {c: floats[:, k] for k, c in enumerate(self.float_names)}

    def _slow(self, lines: list[str], before: int) -> tuple[Columns, Columns]:
        chunk = list(csv.reader(lines))
        header, path = self.header, self.path
        bad = next((i for i, r in enumerate(chunk) if len(r) != len(header)), None)
        if bad is not None:
            raise RunDirError(
                f"{path} row {before + bad + 2} has {len(chunk[bad])} cells, "
                f"header has {len(header)}"
            )
        cells = list(zip(*chunk, strict=True))
        counts = {c: _int_cells(c, cells[self.where[c]], path) for c in SUMMED_REQUEST_COLUMNS}
        floats = {
            c: _numeric(c, cells[self.where[c]], path).astype(np.float64) for c in self.float_names
        }
        return counts, floats


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
    totals, requests = read_requests(path / "requests.csv")
    timeline = read_columns(path / "timeline.csv", TIMELINE_COLUMNS)
    return Run(
        path=path, report=report, requests=requests, request_totals=totals, timeline=timeline
    )


# ---- report.json against its schema -----------------------------------------------------------


class ReportSchemaError(PrefixCacheError, ValueError):
    """report.json does not match the schema; ``problems`` lists each mismatch by JSON path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"report.json does not match its schema:\n  {shown}{more}")


@cache
def load_schema() -> dict[str, Any]:
    text = resources.files("prefixcache.report").joinpath("schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _is_type(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "array":
        return isinstance(value, list)
    if name == "object":
        return isinstance(value, dict)
    raise ValueError(f"schema uses unsupported type {name!r}")


def _check(value: Any, schema: dict[str, Any], path: str, out: list[str]) -> None:
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, n) for n in names):
            out.append(f"{path}: expected {' or '.join(names)}, got {type(value).__name__}")
            return
    if isinstance(value, float) and not math.isfinite(value):
        out.append(f"{path}: {value} is not a finite number")
        return
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        out.extend(
            f"{path}: missing key {k!r}" for k in schema.get("required", ()) if k not in value
        )
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{path}.{key}", out)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", out)


def schema_problems(report: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every way ``report`` departs from the schema; empty when it is valid."""
    out: list[str] = []
    version = report.get("schema_version") if isinstance(report, dict) else None
    if isinstance(version, int) and version != SCHEMA_VERSION:
        return [
            f"$.schema_version: {version} is not one of [{SCHEMA_VERSION}] (this prefixcache "
            f"reads version {SCHEMA_VERSION} reports)"
        ]
    _check(report, load_schema() if schema is None else schema, "$", out)
    return out


def validate_report(report: Any) -> None:
    """Raise :class:`ReportSchemaError` unless ``report`` matches the schema."""
    problems = schema_problems(report)
    if problems:
        raise ReportSchemaError(problems)
