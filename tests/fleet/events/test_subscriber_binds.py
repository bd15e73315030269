"""A subscriber that binds its replica's event endpoint, for engines that connect to it.

vLLM binds its PUB socket only for ``*``, ``::`` or ipc addresses and connects to any other
(``tcp://127.0.0.1:PORT``): the subscriber then binds, before the engine starts, and the
engine's batches reach the index as from a bound publisher; a restarted engine connects again
to the same bound socket.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import zmq
from fleet_support import manager_digests, wait_until

from prefixcache import CacheManager, Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.events.publisher import to_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.events.wire import KVEventBatch, WireLayout, encode_batch, encode_seq
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.manager.block_events import CacheEvent

P = 4
NS = Namespace("llama")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ConnectingEngine:
    """A manager whose KV events go out on a PUB socket that connects, as vLLM's does with a
    plain host address."""

    def __init__(self, endpoint: str) -> None:
        self.mgr = CacheManager(24, P)
        self.pending: list[Any] = []
        self.mgr.add_listener(self._on_event)
        self.seq = 0
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def _on_event(self, event: CacheEvent) -> None:
        self.pending.append(to_wire(event))

    def flush(self) -> None:
        if not self.pending:
            return
        batch = KVEventBatch(time.time(), self.pending, 0)
        self.pending = []
        payload = encode_batch(batch, WireLayout.MAP_EVENTS)
        self.sock.send_multipart((b"", encode_seq(self.seq), payload))
        self.seq += 1

    def step(self, rng: random.Random, n: int) -> None:
        for k in range(n):
            rid = f"r{self.seq}-{k}"
            prompt = [rng.randrange(3)] * 8 + [rng.randrange(1000) for _ in range(5)]
            try:
                self.mgr.admit(rid, prompt, NS)
            except Exception:
                self.mgr.evict(self.mgr.block_counts().cached)
                continue
            self.mgr.end_step()
            self.mgr.release(rid)
            self.flush()

    def close(self) -> None:
        self.sock.close(linger=0)


def _joined(sub: KVEventSubscriber, engine: ConnectingEngine, name: str) -> None:
    """Clear the engine's cache (an event) until the subscriber has one of its batches: a PUB
    that connects loses what it sends before the connection is up, as vLLM's does."""
    before = sub.counters()[name].batches
    wait_until(
        lambda: (
            engine.mgr.reset(force=True),
            engine.flush(),
            sub.counters()[name].batches > before,
        )[2],
        what=f"{name} connected",
    )


def test_a_bound_endpoint_takes_the_batches_of_an_engine_that_connects() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(index, [ReplicaEndpoint("vllm-0", endpoint, None, NS, P, bind=True)])
    sub.start()  # bound when start returns: an engine started after it loses nothing
    engine = ConnectingEngine(endpoint)
    try:
        _joined(sub, engine, "vllm-0")
        engine.step(random.Random(1), 20)
        wait_until(
            lambda: set(index.holdings("vllm-0")) == manager_digests(engine.mgr),
            what="the index holding the engine's blocks",
        )
        assert manager_digests(engine.mgr)
        # the engine restarts: a new socket connects to the same bound endpoint
        engine.close()
        engine = ConnectingEngine(endpoint)
        _joined(sub, engine, "vllm-0")
        engine.step(random.Random(2), 10)
        wait_until(
            lambda: set(index.holdings("vllm-0")) == manager_digests(engine.mgr),
            what="the restarted engine's blocks",
        )
        assert sub.counters()["vllm-0"].malformed == 0
    finally:
        sub.stop()
        engine.close()


def test_the_bound_port_is_held_from_start_to_stop() -> None:
    port = _free_port()
    sub = KVEventSubscriber(
        MemoryFleetIndex(),
        [ReplicaEndpoint("vllm-0", f"tcp://127.0.0.1:{port}", None, NS, P, bind=True)],
    )
    sub.start()
    try:
        probe = zmq.Context.instance().socket(zmq.PUB)
        try:
            with pytest.raises(zmq.ZMQError):
                probe.bind(f"tcp://127.0.0.1:{port}")
        finally:
            probe.close(linger=0)
    finally:
        sub.stop()


def _config(replica: dict[str, Any]) -> Any:
    return parse_config({"replicas": [{"name": "a", "model": "m", **replica}]})


def test_the_config_names_who_binds_the_events_endpoint() -> None:
    bound = _config({"events": "tcp://127.0.0.1:5557", "events_bind": True})
    assert bound.replicas[0].events_bind is True
    assert _config({"events": "tcp://*:5557", "events_bind": True}).replicas[0].events_bind
    assert _config({"events": "tcp://10.0.0.5:5557"}).replicas[0].events_bind is False
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.events.*bind address"):
        _config({"events": "tcp://*:5557"})
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.events_bind.*true or false"):
        _config({"events": "tcp://127.0.0.1:5557", "events_bind": "yes"})
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.events_bind.*needs an events"):
        _config({"events_bind": True})
