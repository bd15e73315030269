"""A store named by a URL, opened once per process and shared by whatever in it uses the store.

``lmdb://PATH[?capacity=SIZE]`` (or a bare path) is the one-host LMDB store on ``PATH``,
holding at most ``SIZE`` of records (``4GiB``, ``512MiB``, a byte count; 1 GiB by default).
``mooncake://MASTER:PORT?metadata=URL[&local_hostname=HOST][&segment=MiB][&buffer=MiB]
[&metrics=URL]`` is a Mooncake Store client (``MooncakeBlockStore.from_url``): ``local_hostname``
is the address other hosts read this one's memory at (by default the one this host reaches the
master from), ``segment`` the memory it contributes to the store (256 MiB), ``buffer`` its
transfer buffer (64 MiB), ``metrics`` the master's ``/metrics`` (its evictions).

An engine's processes may hold several users of one store (vLLM's scheduler and worker roles of
its connector can share a process), and LMDB must not be opened twice in one process:
``acquire_store`` hands every user of a URL the same client, ``release_store`` closes it after
the last one.
"""

from __future__ import annotations

import re
import threading
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

from prefixcache.errors import ConfigError
from prefixcache.store.backend import KVBlockStore

_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MIB = 1 << 20


def parse_size(text: str | int) -> int:
    """Bytes from ``1073741824``, ``1GiB``, ``512M``, ``64MiB``."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    found = _SIZE.fullmatch(str(text))
    if found is None:
        raise ConfigError(f"a size is a byte count or a number with KiB/MiB/GiB/TiB: {text!r}")
    return int(found.group(1)) * _UNITS[(found.group(2) or "")[:1].upper()]


def check_store_url(url: str) -> None:
    """ConfigError unless ``url`` names a store this connector can open (nothing is opened)."""
    parts = urlsplit(url)
    if parts.scheme == "mooncake":
        query = parse_qs(parts.query)
        if not parts.netloc or "metadata" not in query:
            raise ConfigError(
                f"a Mooncake Store URL is mooncake://MASTER:PORT?metadata=URL, got {url!r}"
            )
        for key in ("segment", "buffer"):
            if key in query and not query[key][-1].isdigit():
                raise ConfigError(f"{key} is a count of MiB in {url!r}")
    elif parts.scheme == "lmdb":
        if not unquote(parts.path):
            raise ConfigError(f"an LMDB store URL is lmdb:///PATH[?capacity=SIZE], got {url!r}")
        capacity = parse_qs(parts.query).get("capacity")
        if capacity:
            parse_size(capacity[-1])
    elif parts.scheme:
        raise ConfigError(f"unknown store {url!r}: lmdb://PATH or mooncake://MASTER:PORT?...")


def open_store(url: str) -> KVBlockStore:
    """A new client of the store ``url`` names (ConfigError when it cannot be opened)."""
    check_store_url(url)
    parts = urlsplit(url)
    if parts.scheme == "mooncake":
        from prefixcache.store.mooncake import MooncakeBlockStore

        return MooncakeBlockStore.from_url(url)
    from prefixcache.store.lmdb import LMDBBlockStore

    path = unquote(parts.path) if parts.scheme == "lmdb" else url
    capacity = parse_qs(parts.query).get("capacity") if parts.scheme == "lmdb" else None
    if capacity:
        return LMDBBlockStore(path, capacity_bytes=parse_size(capacity[-1]))
    return LMDBBlockStore(path)


class _Shared(NamedTuple):
    store: KVBlockStore
    users: int


_open: dict[str, _Shared] = {}
_open_lock = threading.Lock()


def acquire_store(url: str) -> KVBlockStore:
    """This process's client of ``url``, opened on first use; give it back with
    ``release_store``."""
    with _open_lock:
        shared = _open.get(url)
        if shared is None:
            shared = _Shared(open_store(url), 0)
        _open[url] = _Shared(shared.store, shared.users + 1)
        return shared.store


def release_store(url: str) -> None:
    """One user of ``url`` is done; the last one closes the client."""
    with _open_lock:
        shared = _open.get(url)
        if shared is None:
            return
        if shared.users > 1:
            _open[url] = _Shared(shared.store, shared.users - 1)
            return
        del _open[url]
    shared.store.close()
