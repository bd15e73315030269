"""The store connector's settings (vLLM's ``kv_connector_extra_config``) and the store it opens.

    --kv-transfer-config '{"kv_connector": "PrefixcacheStoreConnector",
      "kv_connector_module_path": "prefixcache.engines.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "lmdb:///dev/shm/prefixcache-kv?capacity=4GiB"}}'

``store`` is ``lmdb://PATH[?capacity=SIZE]`` (or a bare path) for the one-host LMDB store, or
``mooncake://MASTER:PORT?metadata=URL[&local_hostname=HOST][&segment=MiB][&buffer=MiB]
[&metrics=URL]`` for Mooncake Store. The other keys, all optional: ``model`` (the namespace's
model; the served model name by default, as the service's replica ``model``), ``extra`` (the
replica's ``extra`` namespace keys), ``hash_algo`` (the service's ``hash_algo``, ``xxh3_128`` by
default), ``queue_blocks`` (blocks waiting to be written; past it they are dropped, 1024) and
``retry_after`` (seconds the store is left alone after it failed, 2).

A process opens one store per ``store`` value and shares it between the connector's roles: the
scheduler and the worker may run in one process, and LMDB must not be opened twice in one.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

from prefixcache.blocks.hashing import HASH_FUNCTIONS
from prefixcache.errors import ConfigError
from prefixcache.store.backend import KVBlockStore

_KEYS = ("store", "model", "extra", "hash_algo", "queue_blocks", "retry_after")
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MIB = 1 << 20


class StoreSettings(NamedTuple):
    """What ``kv_connector_extra_config`` says, checked."""

    store: str  # the store URL (or LMDB path)
    model: str | None  # the namespace's model; None: vLLM's served model name
    extra: tuple[str, ...]  # further namespace keys, as the replica's ``extra``
    hash_algo: str  # prefixcache's block digest (the service's ``hash_algo``)
    queue_blocks: int  # blocks waiting to be written before more are dropped
    retry_after: float  # seconds the store is left alone after it failed


def parse_settings(extra_config: Mapping[str, Any] | None) -> StoreSettings:
    """The settings in vLLM's ``kv_connector_extra_config``; ConfigError naming what is wrong."""
    given = dict(extra_config or {})
    unknown = sorted(set(given) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"prefixcache store connector: unknown setting(s) {unknown}; known: {list(_KEYS)}"
        )
    store = given.get("store")
    if not isinstance(store, str) or not store.strip():
        raise ConfigError(
            "prefixcache store connector: kv_connector_extra_config needs 'store': "
            "lmdb://PATH or mooncake://MASTER:PORT?metadata=URL"
        )
    model = given.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ConfigError(f"'model' must be a non-empty string, got {model!r}")
    extra = given.get("extra", ())
    if not isinstance(extra, list | tuple) or not all(isinstance(x, str) for x in extra):
        raise ConfigError(f"'extra' must be a list of strings, got {extra!r}")
    algo = given.get("hash_algo", "xxh3_128")
    if algo not in HASH_FUNCTIONS:
        raise ConfigError(f"'hash_algo' must be one of {sorted(HASH_FUNCTIONS)}, got {algo!r}")
    queue_blocks = given.get("queue_blocks", 1024)
    if isinstance(queue_blocks, bool) or not isinstance(queue_blocks, int) or queue_blocks < 1:
        raise ConfigError(f"'queue_blocks' must be a positive int, got {queue_blocks!r}")
    retry_after = given.get("retry_after", 2.0)
    if (
        isinstance(retry_after, bool)
        or not isinstance(retry_after, int | float)
        or not 0 <= retry_after < float("inf")
    ):
        raise ConfigError(f"'retry_after' must be seconds >= 0, got {retry_after!r}")
    check_store_url(store)
    return StoreSettings(store, model, tuple(extra), algo, queue_blocks, float(retry_after))


def transfer_config(store: str, **settings: Any) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for this connector on ``store`` (more settings by
    name: ``model``, ``extra``, ``hash_algo``, ``queue_blocks``, ``retry_after``)."""
    parse_settings({"store": store, **settings})
    return json.dumps(
        {
            "kv_connector": "PrefixcacheStoreConnector",
            "kv_connector_module_path": "prefixcache.engines.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, **settings},
        }
    )


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
        from prefixcache.store.mooncake_backend import MooncakeBlockStore

        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return MooncakeBlockStore(
            parts.netloc,
            query["metadata"],
            local_hostname=query.get("local_hostname", "127.0.0.1"),
            segment_bytes=int(query.get("segment", "256")) * MIB,
            buffer_bytes=int(query.get("buffer", "64")) * MIB,
            metrics_url=query.get("metrics"),
        )
    from prefixcache.store.lmdb_backend import LMDBBlockStore

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
