"""Connecting the Redis fleet index: client options, index URLs, and on a Redis Cluster the node
that serves the index's one hash slot.

On a cluster (``redis+cluster://host:port``) every key of the index carries one hash tag (the
default prefix is ``{prefixcache:fleet}``), so all of them fall in one slot; the index talks to
the node serving that slot, finds it from any node of the cluster, and finds it again after a
failure (a failover, or a resharding that moved the slot). The cluster gives availability, not
sharding: one node holds the whole index.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from prefixcache.errors import ConfigError
from prefixcache.fleet.index.url_checks import redact

DEFAULT_PREFIX = "prefixcache:fleet"
DEFAULT_CLUSTER_PREFIX = "{prefixcache:fleet}"  # the hash tag puts every key in one slot

# short timeouts and no client-side retries: a dead server is noticed at once
CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 1.0,
    "retry": Retry(NoBackoff(), 0),
}


class IndexURL(NamedTuple):
    """An index URL taken apart."""

    url: str  # the URL a plain client opens (``+cluster`` dropped from the scheme)
    cluster: bool  # whether it names a Redis Cluster


def parse_index_url(url: str) -> IndexURL:
    """``redis://host:port/db`` or ``redis+cluster://host:port`` (``rediss`` too), taken
    apart."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    plain = urlunsplit(parts._replace(scheme=scheme.removesuffix("+cluster")))
    return IndexURL(plain, scheme.endswith("+cluster"))


def open_client(url: str, original: str | None = None) -> redis.Redis:
    """A client of the Redis at ``url`` with the index's options; ConfigError (naming
    ``original``, the URL as given) when it is no Redis URL."""
    try:
        return redis.Redis.from_url(url, **CLIENT_OPTIONS)
    except ValueError as exc:
        raise ConfigError(f"not a Redis URL: {redact(original or url)!r} ({exc})") from None


def timed_client(client: redis.Redis, timeout: float) -> redis.Redis:
    """A client of the same Redis as ``client`` (its options, a pool of its own) whose calls
    and connects time out after ``timeout`` seconds; ``client`` itself when it has no pool."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return client
    kwargs = dict(pool.connection_kwargs)
    kwargs["socket_timeout"] = timeout
    connect = kwargs.get("socket_connect_timeout")
    kwargs["socket_connect_timeout"] = min(connect or timeout, timeout)
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )


def check_cluster_prefix(prefix: str) -> None:
    """ConfigError unless ``prefix`` carries a hash tag, which a cluster needs."""
    if hash_tag(prefix) is None:
        raise ConfigError(
            f"on Redis Cluster the prefix needs a {{hash tag}} so that every key shares one "
            f"slot, e.g. {DEFAULT_CLUSTER_PREFIX!r}; got {prefix!r}"
        )


class ClusterSlotOwner:
    """Finds the node of a Redis Cluster that serves one key's slot (every key of the index).

    The cluster client is kept once it reached the cluster, so its list of nodes (every node it
    saw, not just the one in the URL) seeds the next search: a failover of the URL's node is
    followed too."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key
        self._cluster: RedisCluster | None = None

    def client(self) -> redis.Redis:
        """A client of the node serving the key's slot now (the cluster asked afresh)."""
        if self._cluster is None:
            self._cluster = RedisCluster.from_url(self.url, **CLIENT_OPTIONS)
        else:
            self._cluster.nodes_manager.initialize()
        node = self._cluster.get_node_from_key(self.key)
        if node is None:
            raise RedisClusterException(f"no node serves the slot of {self.key!r}")
        return redis.Redis.from_url(node_url(self.url, node.host, node.port), **CLIENT_OPTIONS)

    def close(self) -> None:
        """Close the cluster client (a later ``client()`` opens another)."""
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def not_a_cluster(exc: BaseException) -> bool:
    """Whether ``exc`` says the Redis asked is no cluster."""
    return (
        isinstance(exc, RedisClusterException) and "cluster mode is not enabled" in str(exc).lower()
    )


def node_url(url: str, host: str, port: int) -> str:
    """``url`` (scheme, credentials, options) pointed at one node, database 0."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
    return urlunsplit(
        parts._replace(netloc=f"{userinfo}@{address}" if userinfo else address, path="")
    )


def hash_tag(prefix: str) -> str | None:
    """The hash tag of a key prefix (``{...}``, non-empty), as Redis Cluster reads it."""
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start >= 0 else -1
    return prefix[start + 1 : end] if end > start + 1 else None
