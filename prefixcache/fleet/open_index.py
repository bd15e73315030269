"""Open a fleet index from a URL: ``memory`` or ``redis://host:port/db``."""

from __future__ import annotations

from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.fleet.memory_index import MemoryFleetIndex
from prefixcache.fleet.redis_index import RedisFleetIndex


def open_index(url: str, **options: Any) -> MemoryFleetIndex | RedisFleetIndex:
    """The index ``url`` names: ``"memory"`` (this process) or ``redis://host:port/db`` (shared;
    ``rediss://`` and ``unix://`` too). ``options`` go to the index's constructor."""
    if not isinstance(url, str):
        raise ConfigError(f"index URL must be a str, got {type(url).__name__}")
    if url == "memory":
        return MemoryFleetIndex(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisFleetIndex.from_url(url, **options)
    raise ConfigError(f"unknown index URL {url!r}: use 'memory' or 'redis://host:port/db'")
