"""Reading a configuration file's values: one reader per file, whose checks name the file and
the place of every mistake (``fleet.yaml: replicas[2].block_size: expected an integer >= 1``)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefixcache.errors import ConfigError, PrefixCacheError

# tcp://host:port to connect to: ``*`` (bind to every interface) is an engine's bind address
_ENDPOINT = re.compile(r"(tcp://[^\s:/*]+:\d{1,5}|ipc://\S+|inproc://\S+)")


class ConfigReader:
    """Reads values of one configuration source (a file's name, for the messages): each method
    returns the value checked and typed, or raises the ConfigError naming the place."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> ConfigError:
        """The error for ``where`` (a dotted place, "" for the file itself)."""
        return ConfigError(
            f"{self.source}: {where}: {message}" if where else f"{self.source}: {message}"
        )

    @contextmanager
    def at(self, where: str, kind: type[PrefixCacheError] = ConfigError) -> Iterator[None]:
        """An error of ``kind`` inside (another module's check) as this reader's at ``where``."""
        try:
            yield
        except kind as exc:
            raise self.fail(where, str(exc)) from None

    def mapping(self, value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
        """A mapping whose keys are all ``known`` ({} for None)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in known:
                raise self.fail(where, f"unknown key {key!r}; known keys: {', '.join(known)}")
        return value

    def string(self, value: Any, where: str, *, optional: bool = True) -> str | None:
        """A non-empty string (None for None when ``optional``)."""
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, value: Any, where: str, minimum: int) -> int:
        """An int of at least ``minimum`` (a bool is no int here)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(where, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def number(self, value: Any, where: str) -> float:
        """A positive finite number, as a float."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise self.fail(where, f"expected a positive finite number, got {value!r}")
        return float(value)

    def share(self, value: Any, where: str) -> float:
        """A share in (0, 1], as a float."""
        share = self.number(value, where)
        if share > 1:
            raise self.fail(where, f"expected a share in (0, 1], got {share!r}")
        return share

    def flag(self, value: Any, where: str) -> bool:
        """True or false (no other value stands for one)."""
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {value!r}")
        return value

    def existing_file(self, text: str, where: str, base_dir: Path | None) -> Path:
        """``text`` as a path (relative ones from ``base_dir``) to a file that exists."""
        path = Path(text)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise self.fail(where, f"file {str(path)!r} does not exist")
        return path

    def url(self, value: Any, where: str) -> str | None:
        """An http(s)://host[:port] URL without its trailing slash (None for None)."""
        text = self.string(value, where)
        if text is None:
            return None
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise self.fail(where, f"expected an http(s)://host:port URL, got {text!r}")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise self.fail(where, f"bad port in {text!r}") from None
        return text.rstrip("/")

    def endpoint(self, value: Any, where: str, *, bind: bool = False) -> str | None:
        """A ZMQ endpoint to connect to (with ``bind``, to bind: ``tcp://*:port`` too):
        tcp://host:port, ipc:// or inproc:// (None for None)."""
        text = self.string(value, where)
        if text is not None and bind and text.startswith("tcp://*:"):
            text = text.replace("*", "0.0.0.0", 1)
        if text is not None and text.startswith("tcp://*"):
            raise self.fail(
                where,
                f"{text!r} is a bind address (the engine's); give the engine's host, e.g. "
                f"{text.replace('*', '127.0.0.1', 1)!r}",
            )
        if text is not None and not _ENDPOINT.fullmatch(text):
            raise self.fail(
                where, f"expected a ZMQ endpoint tcp://host:port or ipc://path, got {text!r}"
            )
        if text is not None and text.startswith("tcp://"):
            port = int(text.rsplit(":", 1)[1])
            if not 0 < port < 65536:
                raise self.fail(where, f"port {port} in {text!r} is not in 1..65535")
        return text
