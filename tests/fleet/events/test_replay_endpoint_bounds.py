"""A replay endpoint that answers slowly, or without end, is bounded: the replay ends by its
deadline or frame cap (an unfilled gap), and the other replicas' events keep arriving."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
from fleet_support import wait_until

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import ConfigError
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.replay_client import fetch_batches
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex

log = logging.getLogger(__name__)
P = 4
DEADLINE = 3.0  # of the dripping replay; the healthy replica's events come well before it


def _batch(first_token: int, h: int) -> bytes:
    tokens = list(range(first_token, first_token + P))
    stored = kv_wire.WireBlockStored([h], None, tokens, P, None, "GPU", None)
    return kv_wire.encode_batch(kv_wire.KVEventBatch(1.0, [stored]))


def _digest(first_token: int) -> bytes:
    return BlockHasher(P).hash_prompt(
        list(range(first_token, first_token + P)), Namespace("llama")
    )[0]


class _Dripper:
    """A ROUTER that answers every replay request with one frame per ``every`` seconds (batches
    outside the range asked for), never its end; ``fast``: as fast as it can."""

    def __init__(self, ctx: zmq.Context, every: float) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.every = every
        self.requests = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        clients: list[bytes] = []
        seq = 1000
        while not self.stop.is_set():
            if self.sock.poll(0 if clients and self.every == 0 else 10):
                client, _, _start = self.sock.recv_multipart()
                clients.append(client)
                self.requests += 1
            for c in clients:
                seq += 1
                payload = _batch(0, seq)
                self.sock.send_multipart((c, b"", b"", kv_wire.encode_seq(seq), payload))
            if self.every and clients:
                self.stop.wait(self.every)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def test_a_dripping_replay_ends_by_its_deadline_and_holds_no_other_replica():
    ctx = zmq.Context.instance()
    drip = _Dripper(ctx, every=1.5)
    pubs = {n: ctx.socket(zmq.PUB) for n in ("slow", "ok")}
    ends = {
        n: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for n, s in pubs.items()
    }
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(
        index,
        [
            ReplicaEndpoint("slow", ends["slow"], drip.endpoint, Namespace("llama"), P),
            ReplicaEndpoint("ok", ends["ok"], None, Namespace("llama"), P),
        ],
        replay_timeout=2.0,
        replay_deadline=DEADLINE,
    )
    sub.start()
    try:
        for name, tok in (("slow", 0), ("ok", 500)):
            wait_until(
                lambda name=name, tok=tok: (
                    pubs[name].send_multipart((b"", kv_wire.encode_seq(0), _batch(tok, tok))),
                    sub.counters()[name].batches > 0,
                )[1],
                what=f"{name} connected",
            )
        # "slow" skips batches 1..4: the replay asked for them drips and never ends
        started = time.monotonic()
        pubs["slow"].send_multipart((b"", kv_wire.encode_seq(5), _batch(40, 5)))
        wait_until(lambda: drip.requests > 0, what="replay asked")
        sent = time.monotonic()
        pubs["ok"].send_multipart((b"", kv_wire.encode_seq(1), _batch(600, 1)))
        wait_until(
            lambda: index.holdings("ok").get(_digest(600)) is not None,
            timeout=DEADLINE - 0.5,
            what="the healthy replica's event indexed",
        )
        delay = time.monotonic() - sent
        assert sub.counters()["slow"].last_seq == 0  # while the dripping replay went on
        log.info("healthy replica's event indexed %.3f s after it was sent", delay)
        print(f"healthy replica's event indexed {delay:.3f} s after it was sent")
        wait_until(
            lambda: sub.counters()["slow"].last_seq == 5, timeout=DEADLINE + 5, what="gap over"
        )
        ended = time.monotonic() - started
        print(f"dripping replay over {ended:.3f} s after the gap")
        c = sub.counters()["slow"]
        assert c.gaps == 1 and c.replays == 0 and c.cleared >= 1  # an unfillable gap
        assert set(index.holdings("slow")) == {_digest(40)}
        assert ended < DEADLINE + 1.5  # its deadline, well before the drip would end it
    finally:
        sub.stop()
        drip.close()
        for s in pubs.values():
            s.close(linger=0)


def test_a_replay_answer_past_the_frame_cap_is_an_unfilled_gap():
    ctx = zmq.Context.instance()
    drip = _Dripper(ctx, every=0)
    try:
        started = time.monotonic()
        got = fetch_batches(
            ctx, drip.endpoint, 1, 3, timeout_s=2.0, replica="r", deadline_s=30.0, max_frames=50
        )
        assert got is None
        assert time.monotonic() - started < 10.0
    finally:
        drip.close()


def test_replay_bounds_are_checked():
    with pytest.raises(ConfigError):
        KVEventSubscriber(MemoryFleetIndex(), replay_deadline=0)
    with pytest.raises(ConfigError):
        KVEventSubscriber(MemoryFleetIndex(), max_replay_frames=1)


def test_a_replica_removed_while_its_replay_drips_leaves_nothing_behind():
    ctx = zmq.Context.instance()
    drip = _Dripper(ctx, every=0.5)
    pub = ctx.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    index = MemoryFleetIndex()
    ep = ReplicaEndpoint("slow", endpoint, drip.endpoint, Namespace("llama"), P)
    sub = KVEventSubscriber(index, [ep], replay_deadline=1.5)
    sub.start()
    try:
        wait_until(
            lambda: (
                pub.send_multipart((b"", kv_wire.encode_seq(0), _batch(0, 0))),
                sub.counters()["slow"].batches > 0,
            )[1],
            what="connected",
        )
        pub.send_multipart((b"", kv_wire.encode_seq(5), _batch(40, 5)))
        wait_until(lambda: drip.requests > 0, what="replay asked")
        sub.remove_replica("slow")  # not held up by the replay either
        time.sleep(2.0)  # the replay ends by its deadline meanwhile
        assert index.holdings("slow") == {} and index.replicas() == []
    finally:
        sub.stop()
        drip.close()
        pub.close(linger=0)
