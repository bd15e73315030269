"""Open a fleet index from a URL: ``memory``, ``redis://host:port/db`` or
``redis+cluster://host:port``.

Backends are imported on demand, so the in-memory index never needs the Redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prefixcache.errors import ConfigError

if TYPE_CHECKING:
    from prefixcache.fleet.index.memory_index import MemoryFleetIndex
    from prefixcache.fleet.index.redis_index import RedisFleetIndex


def open_index(url: str, **options: Any) -> MemoryFleetIndex | RedisFleetIndex:
    """The index ``url`` names: ``"memory"`` (this process), ``redis://host:port/db`` (shared;
    ``rediss://`` too) or ``redis+cluster://host:port`` (a Redis Cluster). ``options`` go to the
    index's constructor. Raises ConfigError for any other URL."""
    url = check_index_url(url)
    if url == "memory":
        from prefixcache.fleet.index.memory_index import MemoryFleetIndex

        return MemoryFleetIndex(**options)
    from prefixcache.fleet.index.redis_index import RedisFleetIndex

    return RedisFleetIndex.from_url(url, **options)


def check_index_url(url: Any, where: str = "index") -> str:
    """``url`` if it names an index backend ("memory", "redis://host[:port][/db]" or
    "redis+cluster://host[:port]")."""
    if url == "memory":
        return url
    parts = urlsplit(url) if isinstance(url, str) else None
    schemes = ("redis", "rediss", "redis+cluster", "rediss+cluster")
    ok = parts is not None and parts.scheme in schemes and bool(parts.hostname)
    if ok and parts is not None:
        try:
            parts.port  # noqa: B018
        except ValueError:
            ok = False
        db = parts.path.strip("/")
        ok = ok and (
            db in ("", "0") if parts.scheme.endswith("+cluster") else db.isdigit() or db == ""
        )
    if not ok:
        raise ConfigError(
            f"{where}: expected 'memory', 'redis://host:port/db' or 'redis+cluster://host:port', "
            f"got {url!r}"
        )
    return str(url)
