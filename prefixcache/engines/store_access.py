"""A store named by a URL, opened once per process and shared by whatever in it uses the store.

The URL is any that ``prefixcache.store.from_url`` reads (``lmdb:///PATH[?capacity=SIZE]``, a
directory, ``mooncake://MASTER:PORT?metadata=URL[&...]``). An engine's processes may hold
several users of one store (vLLM's scheduler and worker roles of its connector can share a
process), and LMDB must not be opened twice in one process: ``acquire_store`` hands every user
of a URL the same client, ``release_store`` closes it after the last one.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from prefixcache.store.backend import KVBlockStore
from prefixcache.store.from_url import open_store


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
