"""Index URLs and key prefixes, checked: which URLs name an index, which prefixes can prefix its
Redis keys (a ``{hash tag}`` on a Redis Cluster), the ``?prefix=`` option split off a URL, and a
URL with its password hidden for error messages. Plain string rules, with no Redis client.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prefixcache.errors import ConfigError

MAX_PREFIX_CHARS = 128
_PREFIX = re.compile(r"[!-~]+")  # printable ASCII, no whitespace


def check_index_prefix(prefix: Any, where: str = "prefix", *, cluster: bool = False) -> str:
    """``prefix`` if it can prefix the index's Redis keys: printable ASCII without whitespace,
    1 to 128 characters, and on a Redis Cluster with a ``{hash tag}`` (every key of the index
    must fall in one slot)."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"{where}: expected a key prefix of printable characters without whitespace, "
            f"got {prefix!r}"
        )
    if len(prefix) > MAX_PREFIX_CHARS:
        raise ConfigError(
            f"{where}: a key prefix of at most {MAX_PREFIX_CHARS} characters, got {len(prefix)}"
        )
    if cluster and not _has_hash_tag(prefix):
        raise ConfigError(
            f"{where}: on Redis Cluster the prefix needs a {{hash tag}} so that every key of the "
            f"index shares one slot, e.g. '{{team-a}}' or 'fleet:{{team-a}}'; got {prefix!r}"
        )
    return prefix


def split_prefix(url: str) -> tuple[str, str | None]:
    """``url`` without its ``prefix`` query option, and that option (None when absent)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [v for k, v in query if k == "prefix"]
    if not prefixes:
        return url, None
    rest = "&".join(  # the other options as written
        part for part in parts.query.split("&") if part.split("=", 1)[0] != "prefix"
    )
    return parts._replace(query=rest).geturl(), prefixes[-1]


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster."""
    return urlsplit(url).scheme.lower().endswith("+cluster")


def _has_hash_tag(prefix: str) -> bool:
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start >= 0 else -1
    return end > start + 1


IN_PROCESS = ("memory", "memory+compact")  # index URLs of this process's own index


def check_index_url(url: Any, where: str = "index") -> str:
    """``url`` if it names an index backend ("memory", "memory+compact",
    "redis://host[:port][/db]" or "redis+cluster://host[:port]")."""
    if url in IN_PROCESS:
        return str(url)
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
    if not ok or parts is None:
        raise ConfigError(
            f"{where}: expected 'memory', 'redis://host:port/db', 'redis+cluster://host:port' "
            f"or 'memory+compact', got {redact(url)!r}"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    for key, value in query:
        if key == "prefix":
            check_index_prefix(value, f"{where}: ?prefix", cluster=is_cluster_url(url))
    return str(url)


def redact(url: Any) -> Any:
    """``url`` with the password of its user info replaced by ``***``, for messages."""
    if not isinstance(url, str):
        return url
    parts = urlsplit(url)
    userinfo, at, address = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{address}").geturl()
