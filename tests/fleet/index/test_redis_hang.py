"""A hung Redis (redis-server paused with SIGSTOP) does not stall routing: reads give up after
their short deadline and are answered from the local view, reconnecting runs on a watcher thread,
and once Redis answers again the index resyncs."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

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


class _RedisReplies:
    """Every reply a Redis client of this process waits for (redis-py's ``read_response``), in
    one order with the routes: where each wait that got no reply began and ended, and any wait
    made by a thread holding one of ``locks``."""

    def __init__(self, locks: dict[str, Any]) -> None:
        self.locks = locks
        self.order = itertools.count()  # one step per event, from any thread (atomic)
        # waits that ended without a reply: where they began and ended, and the thread
        self.unanswered: list[tuple[int, int, str]] = []
        self.held: list[str] = []

    def watch(self, read_response: Callable[..., Any]) -> Callable[..., Any]:
        def watched(conn: Any, *args: Any, **kwargs: Any) -> Any:
            for name, lock in self.locks.items():
                if lock._is_owned():  # the calling thread holds it
                    self.held.append(f"{name} (thread {threading.current_thread().name})")
            began = next(self.order)
            try:
                return read_response(conn, *args, **kwargs)
            except Exception:  # no reply: a timeout (or a connection the timeout broke)
                thread = threading.current_thread().name
                self.unanswered.append((began, next(self.order), thread))
                raise

        return watched


def test_no_lock_is_held_across_a_redis_call_and_routes_go_on_through_every_hung_one(
    redis_server, monkeypatch
):
    """Two replicas publish KV events over ZMQ while redis-server is stopped (SIGSTOP): no
    thread holds the index's lock or the subscriber's while it waits on Redis, every reply
    Redis never gave (a wait that began while it was stopped and timed out) saw routes begin and
    end inside it, and each of those routes answered from the
    router's own view: the replica holding the prompt, with its cached tokens. The reconnect
    ping used to hold the index's lock for its 2 s timeout while an ingest worker waited on that
    lock holding the subscriber's, which every route takes: routes stalled 2 s at a time."""
    import redis

    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex
    from tests.fleet.fleet_processes import PublishingReplica

    index = RedisFleetIndex.from_url(redis_server.url, prefix=f"s{os.urandom(4).hex()}")
    replicas = {name: PublishingReplica(4096, "llama", P) for name in ("a", "b")}
    endpoints = [
        ReplicaEndpoint(name, rep.events, rep.replay, NS, P) for name, rep in replicas.items()
    ]
    sub = KVEventSubscriber(index, endpoints)
    router = Router(index, [ReplicaSpec(name, NS, P) for name in replicas])
    router.attach_held(sub.unplaced)  # as the service does: every route tells the subscriber
    replies = _RedisReplies({"the index's lock": index.sync.lock, "the subscriber's": sub._lock})
    abstract = redis.connection.AbstractConnection
    monkeypatch.setattr(abstract, "read_response", replies.watch(abstract.read_response))
    hot = list(range(1000, 1000 + 8 * P))
    publishing = threading.Event()

    def publish() -> None:
        k = 0
        while publishing.is_set():
            for rep in replicas.values():  # new prompts: stores, the index writes on
                rep.serve([k % 997, *range(5000 + 8 * k, 5000 + 8 * k + 4 * P)])
                k += 1
            time.sleep(0.005)

    sub.start()
    publisher = threading.Thread(target=publish, daemon=True)
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    try:
        wait_until(lambda: _subscribed(replicas, sub), what="the subscriber to hear both")
        replicas["a"].serve(hot)
        wait_until(lambda: router.route(NS, hot).cached_tokens == len(hot), what="the hot prompt")
        publishing.set()
        publisher.start()
        wait_until(lambda: index.stats().errors == 0 and _stored(sub) > 8, what="publishing")
        routes: list[tuple[int, int, str, int]] = []
        os.kill(pid, signal.SIGSTOP)
        stopped = next(replies.order)
        try:

            def hung() -> list[tuple[int, int, str]]:
                return [w for w in list(replies.unanswered) if w[0] > stopped]

            give_up = time.monotonic() + 60.0  # a safeguard: the loop ends on its condition
            while len(hung()) < 4 and time.monotonic() < give_up:
                began = next(replies.order)
                decision = router.route(NS, hot)
                routes.append(
                    (began, next(replies.order), decision.replica, decision.cached_tokens)
                )
            waits = hung()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(waits) >= 4, "Redis was asked nothing while it was stopped"
        # the routes' own thread waits once, the read that finds Redis hung; after it, routes
        # answer from the local view and ask Redis nothing until it is back
        own = [w for w in waits if w[2] == threading.current_thread().name]
        assert len(own) <= 1, f"routes waited on the stopped Redis {len(own)} times"
        others = [w for w in waits if w not in own]
        starved = [w for w in others if not any(w[0] < r[0] and r[1] < w[1] for r in routes)]
        assert starved == [], f"{len(starved)} of {len(others)} hung Redis waits stopped routing"
        assert replies.held == [], f"waited on Redis holding {sorted(set(replies.held))}"
        during = [r for r in routes if r[0] > stopped]
        assert {(r[2], r[3]) for r in during} == {("a", len(hot))}  # from its own view
        assert not index.stats().in_sync
        wait_until(lambda: index.flush(), what="the resync after SIGCONT", timeout=30.0)
    finally:
        publishing.clear()
        if publisher.is_alive():
            publisher.join(10)
        sub.stop()
        index.close()
        for rep in replicas.values():
            rep.publisher.close()


def _subscribed(replicas: dict[str, Any], sub: KVEventSubscriber) -> bool:
    """Whether the subscriber has heard a batch of every replica (they publish until then)."""
    heard = sub.counters()
    for name, rep in replicas.items():
        if heard[name].batches == 0:  # a new prompt each time: one the cache holds adds nothing
            rep.serve(list(range(9000 + 4 * rep.served, 9000 + 4 * rep.served + P)))
    return all(heard[name].batches > 0 for name in replicas)


def _stored(sub: KVEventSubscriber) -> int:
    return sum(c.blocks_stored for c in sub.counters().values())


def test_read_timeout_is_checked():
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    with pytest.raises(ConfigError):
        RedisFleetIndex.from_url("redis://127.0.0.1:1/0", read_timeout=0)
