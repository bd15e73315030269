"""Validation of report.json against ``schema.json``.

A small validator for the part of JSON Schema the file uses (type, required, properties, items,
enum, minimum, maximum, pattern), so reading a report needs no extra dependency.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from typing import Any

from prefixcache.errors import PrefixCacheError
from prefixcache.run_format import SCHEMA_VERSION


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
