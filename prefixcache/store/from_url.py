"""Open a shared K/V store from a URL: ``lmdb:///PATH`` (or a bare path) or
``mooncake://MASTER:PORT?metadata=URL``.

The accepted forms:

- ``lmdb:///PATH[?capacity=SIZE]``: the one-host LMDB store (lmdb.py) in the directory ``PATH``
  (absolute: three slashes; percent-escapes decoded), holding at most ``SIZE`` of records
  (``4GiB``, ``512MiB``, a byte count; at least 1 MiB). Without ``capacity``: the caller's
  default, else the store's (1 GiB, bounded to half the free space).
- ``PATH``, with no scheme: the same store in ``PATH`` (relative or absolute), with no options.
- ``mooncake://MASTER:PORT?metadata=URL[&local_hostname=HOST][&segment=MiB][&buffer=MiB]
  [&metrics=URL]``: a Mooncake Store client (mooncake.py) of the master at ``MASTER:PORT``, whose
  HTTP metadata server is ``metadata``; ``local_hostname`` is the address other hosts read this
  one's memory at (by default the one this host reaches the master from), ``segment`` the
  memory it gives the store (256 MiB), ``buffer`` its transfer buffer (64 MiB), ``metrics`` the
  master's ``/metrics`` (its evictions).

``check_store_url`` reads a URL without opening anything; any other scheme, a missing or
malformed part, an option the store does not take or one given twice is a ``StoreURLError``
(a ``ConfigError``) naming what is wrong, and nothing is created. Backends are imported on
demand, so the LMDB store never needs the Mooncake client, nor the reverse.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from prefixcache.errors import ConfigError
from prefixcache.store.backend import KVBlockStore

__all__ = [
    "LMDBLocation",
    "MooncakeLocation",
    "StoreURLError",
    "check_store_url",
    "open_store",
    "parse_size",
]

MIB = 1 << 20
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_FORMS = "lmdb:///PATH[?capacity=SIZE], a directory, or mooncake://MASTER:PORT?metadata=URL"
_MOONCAKE_OPTIONS = ("metadata", "local_hostname", "segment", "buffer", "metrics")


class StoreURLError(ConfigError):
    """A store URL that names no store, or names one with a missing or bad part."""


class LMDBLocation(NamedTuple):
    """The one-host store a URL names: its directory and capacity (None: not given)."""

    path: str
    capacity_bytes: int | None


class MooncakeLocation(NamedTuple):
    """The Mooncake Store a URL names, as ``MooncakeBlockStore`` takes it."""

    master: str  # HOST:PORT
    metadata: str
    local_hostname: str | None
    segment_bytes: int
    buffer_bytes: int
    metrics_url: str | None


def parse_size(text: str | int) -> int:
    """Bytes from ``1073741824``, ``1GiB``, ``512M``, ``64MiB`` (ConfigError otherwise)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    found = _SIZE.fullmatch(str(text))
    if found is None:
        raise ConfigError(f"a size is a byte count or a number with KiB/MiB/GiB/TiB: {text!r}")
    return int(found.group(1)) * _UNITS[(found.group(2) or "")[:1].upper()]


def check_store_url(url: object) -> LMDBLocation | MooncakeLocation:
    """The store ``url`` names (the forms: this module's docstring), read without opening or
    creating anything; ``StoreURLError`` naming what is wrong when it names none."""
    if not isinstance(url, str) or not url.strip():
        raise StoreURLError(f"a store URL is {_FORMS}; got {url!r}")
    parts = urlsplit(url)
    if parts.scheme == "lmdb":
        return _lmdb_location(url)
    if parts.scheme == "mooncake":
        return _mooncake_location(url)
    if "://" in url:
        raise StoreURLError(f"unknown store {parts.scheme!r} in {url!r}: a store URL is {_FORMS}")
    if "?" in url:
        raise StoreURLError(
            f"a bare path takes no options (lmdb:///PATH?capacity=SIZE does): {url!r}"
        )
    return LMDBLocation(url, None)  # a bare path


def open_store(url: str, *, default_capacity_bytes: int | None = None) -> KVBlockStore:
    """A new client of the store ``url`` names; ``default_capacity_bytes``: an LMDB store's
    capacity where the URL gives none. Raises ``StoreURLError`` for a URL that names no store
    (nothing opened or created) and ConfigError for a store that cannot be opened."""
    location = check_store_url(url)
    if isinstance(location, MooncakeLocation):
        from prefixcache.store.mooncake import MooncakeBlockStore

        return MooncakeBlockStore(
            location.master,
            location.metadata,
            local_hostname=location.local_hostname,
            segment_bytes=location.segment_bytes,
            buffer_bytes=location.buffer_bytes,
            metrics_url=location.metrics_url,
        )
    from prefixcache.store.lmdb import LMDBBlockStore

    capacity = location.capacity_bytes
    return LMDBBlockStore(
        location.path, capacity_bytes=default_capacity_bytes if capacity is None else capacity
    )


def _options(url: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query options of ``url``, each allowed and given once, none empty."""
    options: dict[str, str] = {}
    for key, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key not in allowed:
            raise StoreURLError(
                f"unknown option {key!r} in {url!r}: this store takes {', '.join(allowed)}"
            )
        if key in options:
            raise StoreURLError(f"option {key!r} given twice in {url!r}")
        if not value:
            raise StoreURLError(f"option {key!r} has no value in {url!r}")
        options[key] = value
    return options


def _lmdb_location(url: str) -> LMDBLocation:
    parts = urlsplit(url)
    if parts.netloc:
        raise StoreURLError(
            f"an LMDB store URL takes an absolute path after three slashes "
            f"(lmdb:///dev/shm/kv), not the host {parts.netloc!r}: {url!r}"
        )
    path = unquote(parts.path)
    if not path.strip("/"):
        raise StoreURLError(f"an LMDB store URL needs a directory, lmdb:///PATH: {url!r}")
    options = _options(url, ("capacity",))
    capacity = None
    if "capacity" in options:
        try:
            capacity = parse_size(options["capacity"])
        except ConfigError as exc:
            raise StoreURLError(f"capacity in {url!r}: {exc}") from None
        if capacity < MIB:
            raise StoreURLError(f"capacity in {url!r} is below 1 MiB: {capacity} bytes")
    return LMDBLocation(path, capacity)


def _mooncake_location(url: str) -> MooncakeLocation:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.username or parts.password:
        raise StoreURLError(
            f"a Mooncake Store URL names its master as mooncake://HOST:PORT, got {url!r}"
        )
    if parts.path not in ("", "/"):
        raise StoreURLError(f"a Mooncake Store URL has no path, got {parts.path!r} in {url!r}")
    options = _options(url, _MOONCAKE_OPTIONS)
    if "metadata" not in options:
        raise StoreURLError(
            f"a Mooncake Store URL needs its metadata server, ?metadata=URL: {url!r}"
        )
    sizes: dict[str, int] = {}
    for key, default in (("segment", 256), ("buffer", 64)):
        given = options.get(key, str(default))
        if not given.isdigit():
            raise StoreURLError(f"{key} is a count of MiB in {url!r}, got {given!r}")
        sizes[key] = int(given) * MIB
    return MooncakeLocation(
        parts.netloc,
        options["metadata"],
        options.get("local_hostname"),
        sizes["segment"],
        sizes["buffer"],
        options.get("metrics"),
    )
