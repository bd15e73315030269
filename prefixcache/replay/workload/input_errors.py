"""Errors of the replay package: each names the file and where in it the problem is."""

from __future__ import annotations

from typing import Any

from prefixcache.errors import ConfigError, PrefixCacheError

UNSET: Any = object()  # an argument not given (None is a value)


class ScenarioError(ConfigError):
    """A scenario file is malformed: names the file, the field (a dotted path like
    ``prompt[1].length``; empty for the file as a whole) and what was expected, and what was
    given unless ``got`` is left out (None is a value). A ConfigError."""

    def __init__(self, path: str, field: str, expected: str, got: Any = UNSET) -> None:
        self.path, self.field, self.expected = path, field, expected
        where = f"field '{field}': " if field else ""
        message = f"{path}: {where}expected {expected}"
        if got is not UNSET:
            message += f", got {_show(got)}"
        super().__init__(message)


class TraceFormatError(PrefixCacheError, ValueError):
    """A trace line cannot be read: names the file and the 1-based line number (0 for the
    file as a whole, an empty trace)."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path, self.line = path, line
        super().__init__(f"{path}:{line}: {message}")


def _show(value: Any) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
