"""Reading fields of a parsed scenario file, each failure naming the file, field and expectation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixcache.replay.errors import _UNSET, ScenarioError


class Where:
    """A position in a scenario file: the file and a dotted field path like ``prompt[1].length``."""

    def __init__(self, file: str, path: str = "") -> None:
        self.file, self.path = file, path

    def __truediv__(self, key: str | int) -> Where:
        if isinstance(key, int):
            return Where(self.file, f"{self.path}[{key}]")
        return Where(self.file, f"{self.path}.{key}" if self.path else key)

    def fail(self, expected: str, got: Any = _UNSET) -> ScenarioError:
        return ScenarioError(self.file, self.path or "(top level)", expected, got)


def mapping(value: Any, where: Where, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise where.fail("a mapping", value)
    for key in value:
        if key not in allowed:
            raise (where / str(key)).fail(f"no such field (allowed: {', '.join(allowed)})")
    return value


def get(m: Mapping[str, Any], key: str, where: Where, default: Any = _UNSET) -> Any:
    if key in m and m[key] is not None:
        return m[key]
    if default is _UNSET:
        raise (where / key).fail("a value (the field is required)")
    return default


def integer(value: Any, where: Where, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise where.fail(
                "an integer" + (f" >= {minimum}" if minimum is not None else ""), value
            )
    if minimum is not None and value < minimum:
        raise where.fail(f"an integer >= {minimum}", value)
    return value


def number(value: Any, where: Where, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise where.fail("a number", value)
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise where.fail("a finite number", value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise where.fail(f"a number {'>' if strict else '>='} {minimum:g}", value)
    return value


def string(value: Any, where: Where, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise where.fail("a string" if choices is None else f"one of {', '.join(choices)}", value)
    if choices is not None and value not in choices:
        raise where.fail(f"one of {', '.join(choices)}", value)
    return value


def boolean(value: Any, where: Where) -> bool:
    if not isinstance(value, bool):
        raise where.fail("true or false", value)
    return value


def sequence(value: Any, where: Where, min_len: int = 0) -> list[Any]:
    if not isinstance(value, list):
        raise where.fail("a list", value)
    if len(value) < min_len:
        raise where.fail(f"a list of at least {min_len} item(s)", value)
    return value
