"""A hung Redis (redis-server paused with SIGSTOP) does not stall routing: reads give up after
their short deadline and are answered from the local view, reconnecting runs on a watcher thread,
and once Redis answers again the index resyncs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fleet_support import wait_until

from prefixcache import Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.router import Router

P = 4
NS = Namespace("llama")


def _batch(hashes: list[int], parent: int | None, first_token: int) -> bytes:
    tokens = list(range(first_token, first_token + P * len(hashes)))
    stored = kv_wire.WireBlockStored(hashes, parent, tokens, P, None, "GPU", None)
    return kv_wire.encode_batch(kv_wire.KVEventBatch(1.0, [stored]))


def test_routes_are_answered_while_redis_hangs_and_the_index_resyncs_after(redis_server):
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    prefix = f"h{os.urandom(4).hex()}"
    index = RedisFleetIndex.from_url(
        redis_server.url, prefix=prefix, retry_interval=0.2, read_timeout=0.2
    )
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod", namespace=NS, block_size=P)])
    router = Router(index, [ReplicaSpec("pod", NS, P), ReplicaSpec("idle", NS, P)])
    sub.ingest("pod", 0, _batch([1, 2, 3, 4], None, 0))
    assert index.flush()
    prompt = list(range(4 * P))
    assert router.route(NS, prompt).cached_tokens == 4 * P
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    latencies: list[float] = []
    writer = threading.Thread(  # the ingestion goes on: its flush hangs on the paused Redis
        target=lambda: (sub.ingest("pod", 1, _batch([5], 4, 4 * P)), index.flush()),
        daemon=True,
    )
    os.kill(pid, signal.SIGSTOP)
    try:
        writer.start()
        window = time.monotonic() + 3.0
        while time.monotonic() < window:
            started = time.monotonic()
            decision = router.route(NS, prompt)
            latencies.append(time.monotonic() - started)
            assert decision.replica == "pod"
        writer.join(10)
        ordered = sorted(latencies)
        print(
            f"{len(latencies)} routes while Redis was paused: p50 "
            f"{ordered[len(ordered) // 2] * 1000:.1f} ms, p99 "
            f"{ordered[int(len(ordered) * 0.99)] * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
        )
        assert len(latencies) >= 10  # answered all along, not one per hung call
        assert not index.stats().in_sync
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: index.stats().in_sync, what="resync after SIGCONT")
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    try:
        assert fresh.holdings("pod") == index.local.holdings("pod")
        assert len(fresh.holdings("pod")) == 5  # the store made while Redis was paused too
        assert router.route(NS, prompt + list(range(4 * P, 5 * P))).cached_tokens == 5 * P
    finally:
        fresh.close()
        index.close()


def test_read_timeout_is_checked():
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    with pytest.raises(ConfigError):
        RedisFleetIndex.from_url("redis://127.0.0.1:1/0", read_timeout=0)
