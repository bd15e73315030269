"""A replay's run directory, loaded: report.json plus the per-request and timeline CSV files.

report.json is validated against ``schema.json`` by a small validator for the part of JSON Schema
the file uses (type, required, properties, items, enum, minimum, maximum, pattern), so reading a
report needs no extra dependency.
"""

from __future__ import annotations

import csv
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
from prefixcache.run_format import REQUEST_COLUMNS, SCHEMA_VERSION, TIMELINE_COLUMNS

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
