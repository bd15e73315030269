"""The store connector's settings (vLLM's ``kv_connector_extra_config``) and the store it opens.

    --kv-transfer-config '{"kv_connector": "PrefixcacheStoreConnector",
      "kv_connector_module_path": "prefixcache.engines.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "lmdb:///dev/shm/prefixcache-kv?capacity=4GiB"}}'

``store`` names the store (the forms: store/from_url.py): ``lmdb:///PATH[?capacity=SIZE]`` for
the one-host LMDB store, ``mooncake://MASTER:PORT?metadata=URL[&local_hostname=HOST]...`` for
Mooncake Store. The other keys, all optional: ``model`` (the namespace's model; the served
model name by default, as the service's replica ``model``), ``weights`` (the exact weights
behind that name, ``Namespace.weights``: a revision or a weights fingerprint; vLLM's
``--revision`` by default, when given), ``extra`` (the replica's ``extra`` namespace keys),
``hash_algo`` (the service's ``hash_algo``, ``xxh3_128`` by default), ``queue_blocks`` (blocks
waiting to be written; past it they are dropped, 1024), ``queue_bytes`` (the buffers of the
blocks waiting, at most: fewer blocks wait when they are large, ``1GiB``) and ``retry_after``
(seconds the store is left alone after it failed, 2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from prefixcache.blocks.hashing import HASH_FUNCTIONS
from prefixcache.errors import ConfigError
from prefixcache.store.from_url import check_store_url, parse_size

_KEYS = (
    "store",
    "model",
    "weights",
    "extra",
    "hash_algo",
    "queue_blocks",
    "queue_bytes",
    "retry_after",
)


class StoreSettings(NamedTuple):
    """What ``kv_connector_extra_config`` says, checked."""

    store: str  # the store URL (or LMDB path)
    model: str | None  # the namespace's model; None: vLLM's served model name
    weights: str | None  # the exact weights (a revision, a fingerprint); None: vLLM's --revision
    extra: tuple[str, ...]  # further namespace keys, as the replica's ``extra``
    hash_algo: str  # prefixcache's block digest (the service's ``hash_algo``)
    queue_blocks: int  # blocks waiting to be written before more are dropped
    queue_bytes: int  # bytes of the waiting blocks' buffers, at most
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
            "lmdb:///PATH or mooncake://MASTER:PORT?metadata=URL"
        )
    model = given.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ConfigError(f"'model' must be a non-empty string, got {model!r}")
    weights = given.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights):
        raise ConfigError(f"'weights' must be a non-empty string, got {weights!r}")
    extra = given.get("extra", ())
    if not isinstance(extra, list | tuple) or not all(isinstance(x, str) for x in extra):
        raise ConfigError(f"'extra' must be a list of strings, got {extra!r}")
    algo = given.get("hash_algo", "xxh3_128")
    if algo not in HASH_FUNCTIONS:
        raise ConfigError(f"'hash_algo' must be one of {sorted(HASH_FUNCTIONS)}, got {algo!r}")
    queue_blocks = given.get("queue_blocks", 1024)
    if isinstance(queue_blocks, bool) or not isinstance(queue_blocks, int) or queue_blocks < 1:
        raise ConfigError(f"'queue_blocks' must be a positive int, got {queue_blocks!r}")
    try:
        queue_bytes = parse_size(given.get("queue_bytes", "1GiB"))
    except ConfigError:
        queue_bytes = 0
    if queue_bytes < 1:
        raise ConfigError(
            f"'queue_bytes' must be a positive size (bytes, or 512MiB, 1GiB), got "
            f"{given.get('queue_bytes')!r}"
        )
    retry_after = given.get("retry_after", 2.0)
    if (
        isinstance(retry_after, bool)
        or not isinstance(retry_after, int | float)
        or not 0 <= retry_after < float("inf")
    ):
        raise ConfigError(f"'retry_after' must be seconds >= 0, got {retry_after!r}")
    check_store_url(store)
    return StoreSettings(
        store, model, weights, tuple(extra), algo, queue_blocks, queue_bytes, float(retry_after)
    )


def transfer_config(store: str, **settings: Any) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for this connector on ``store`` (more settings by
    name: ``model``, ``weights``, ``extra``, ``hash_algo``, ``queue_blocks``, ``queue_bytes``,
    ``retry_after``)."""
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
