"""The Redis fleet index's script calls as they go to Redis: a pipeline of queued calls after a
read of the data's epoch (``send_calls``), the epoch claimed (``claim_epoch``), and the calls that
write a router's local view back (``view_calls``, sent by ``send_view`` in pipelines small enough
to be answered within the socket timeout). The sync (``sync``) decides when each runs."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import redis

from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.scripts import (
    IndexScripts,
    applied_args,
    as_bytes,
    remember_args,
    store_args,
)
from prefixcache.medium import CPU, GPU

ScriptCall = tuple[Any, list[Any]]  # a registered script and its arguments
EngineSource = Callable[[str], list[tuple[bytes, bytes, int]]]

VIEW_CHUNK = 16  # write-back calls (of up to 1024 blocks each) per pipeline


def send_calls(
    client: redis.Redis, prefix: str, keys: list[str], calls: list[ScriptCall]
) -> tuple[Any, list[Any]]:
    """Run ``calls`` in one pipeline after reading the data's epoch: (the epoch, or None when
    reading it failed, and each call's result, errors included as results)."""
    pipe = client.pipeline(transaction=False)
    pipe.get(prefix + ":epoch")
    for script, args in calls:
        script(keys=keys, args=args, client=pipe)
    epoch, *results = pipe.execute(raise_on_error=False)
    if isinstance(epoch, Exception):  # as any other call's error (a moved slot, say)
        return None, [epoch, *results]
    return epoch, results


def claim_epoch(client: redis.Redis, prefix: str) -> bytes:
    """The epoch of the data in Redis, set now if it has none (a fresh or emptied Redis)."""
    key = prefix + ":epoch"
    pipe = client.pipeline(transaction=False)
    pipe.set(key, uuid.uuid4().hex, nx=True)
    pipe.get(key)
    return as_bytes(pipe.execute()[1])


def view_calls(
    prefix: str,
    scripts: IndexScripts,
    local: MemoryFleetIndex,
    *,
    dropped: set[str],
    engine_source: EngineSource | None,
    applied: Mapping[str, str],
    behind: bool,
) -> list[ScriptCall]:
    """The calls that put a router's view back: its replicas' blocks (``local``), their engine
    maps (``engine_source``) and the last applied batches; first the drops Redis may lack
    (``dropped``) and, when ``behind`` on writes Redis had, a clear of each replica (what it
    removed must go)."""
    calls: list[ScriptCall] = []
    for replica in sorted(dropped):  # dropped while Redis was away
        calls.append((scripts.clear, [prefix, replica, 1]))
    cap, max_replicas = local.max_blocks_per_replica, local.max_replicas
    for replica in local.replicas():
        if behind:
            calls.append((scripts.clear, [prefix, replica, 0]))
        by_medium: dict[str, list[bytes]] = {GPU: [], CPU: []}
        for d, media in local.holdings(replica).items():
            for m in media:
                by_medium[m].append(d)
        for medium, digests in by_medium.items():
            for i in range(0, len(digests), 1024):
                chunk = digests[i : i + 1024]
                args = store_args(prefix, replica, medium, chunk, cap, max_replicas)
                calls.append((scripts.store, args))
        if engine_source is not None:  # and the engine map, as the caller knows it
            entries = engine_source(replica)
            for i in range(0, len(entries), 1024):
                args = remember_args(prefix, replica, entries[i : i + 1024])
                calls.append((scripts.remember, args))
    if applied:
        calls.append((scripts.applied, applied_args(prefix, dict(applied))))
    return calls


def send_view(client: redis.Redis, keys: list[str], calls: list[ScriptCall]) -> None:
    """Send write-back calls, ``VIEW_CHUNK`` a pipeline; a RedisError when one fails."""
    for i in range(0, len(calls), VIEW_CHUNK):
        pipe = client.pipeline(transaction=False)
        for script, script_args in calls[i : i + VIEW_CHUNK]:
            script(keys=keys, args=script_args, client=pipe)
        pipe.execute()
