"""Open a fleet index from a URL: ``memory``, ``redis://host:port/db`` or
``redis+cluster://host:port``.

Backends are imported on demand, so the in-memory index never needs the Redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixcache.fleet.service_config import check_index_url

if TYPE_CHECKING:
    from prefixcache.fleet.memory_index import MemoryFleetIndex
    from prefixcache.fleet.redis_index import RedisFleetIndex


def open_index(url: str, **options: Any) -> MemoryFleetIndex | RedisFleetIndex:
    """The index ``url`` names: ``"memory"`` (this process), ``redis://host:port/db`` (shared;
    ``rediss://`` too) or ``redis+cluster://host:port`` (a Redis Cluster). ``options`` go to the
    index's constructor. Raises ConfigError for any other URL."""
    url = check_index_url(url)
    if url == "memory":
        from prefixcache.fleet.memory_index import MemoryFleetIndex

        return MemoryFleetIndex(**options)
    from prefixcache.fleet.redis_index import RedisFleetIndex

    return RedisFleetIndex.from_url(url, **options)
