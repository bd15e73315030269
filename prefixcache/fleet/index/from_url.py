"""Open a fleet index from a URL: ``memory``, ``redis://host:port/db`` or
``redis+cluster://host:port``.

A Redis URL may carry credentials (``redis://user:password@host:port/db``), use TLS
(``rediss://``) and name the key prefix of the index (``?prefix=team-a``), so that several
deployments share one Redis without mixing their data (the rules: ``url_checks``). Backends are
imported on demand, so the in-memory index never needs the Redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixcache.fleet.index.url_checks import (
    check_index_prefix,
    check_index_url,
    is_cluster_url,
)

if TYPE_CHECKING:
    from prefixcache.fleet.index.memory import MemoryFleetIndex
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

__all__ = ["check_index_prefix", "check_index_url", "open_index"]


def open_index(
    url: str, prefix: str | None = None, **options: Any
) -> MemoryFleetIndex | RedisFleetIndex:
    """The index ``url`` names: ``"memory"`` (this process; ``"memory+compact"``: in at most 64
    bytes per block and replica, slower to write), ``redis://host:port/db`` (shared;
    ``rediss://`` too) or ``redis+cluster://host:port`` (a Redis Cluster). ``prefix`` (or the
    URL's ``?prefix=``) is the Redis key prefix; None: the default. The in-memory index shares
    nothing and ignores it. ``options`` go to the index's constructor. Raises ConfigError for any
    other URL, a bad prefix, or two different prefixes."""
    url = check_index_url(url)
    if prefix is not None:
        check_index_prefix(prefix, cluster=is_cluster_url(url))
    if url == "memory":
        from prefixcache.fleet.index.memory import MemoryFleetIndex

        return MemoryFleetIndex(**options)
    if url == "memory+compact":
        from prefixcache.fleet.index.compact import CompactFleetIndex

        return CompactFleetIndex(**options)
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    if prefix is not None:
        options["prefix"] = prefix
    return RedisFleetIndex.from_url(url, **options)
