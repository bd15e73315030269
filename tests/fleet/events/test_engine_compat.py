"""Compatibility with vLLM 0.33's and SGLang 0.5's KV event streams, with fixtures written from
their published wire format: replay framing in both directions over real ZMQ sockets, the
publisher's default bytes against structs mirroring vLLM 0.33's, media and placeholder stores,
SGLang's ``cache_salt``."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm_structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from prefixcache import CacheManager, Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.publisher import KVEventPublisher, to_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex

P = 4
TOKENS = list(range(100, 108))  # two blocks of P
TIMEOUT_MS = 5000
END_SEQ = b"\xff" * 8

VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def vllm_payload(*events: Any, ts: float = 1.0, rank: int = 0) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts, list(events), rank))


# ---- SGLang 0.5.23's structs (srt/disaggregation/kv_events.py), mirrored --------------------


class SglEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglBlockStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglBlockRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


def sglang_payload(*events: Any, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode(SglEventBatch(ts, list(events), 0))


# ---- helpers ---------------------------------------------------------------------------------


def _subscriber(replay: str | None = None) -> tuple[MemoryFleetIndex, KVEventSubscriber]:
    index = MemoryFleetIndex()
    ep = ReplicaEndpoint("pod", None, replay, Namespace("llama"), P)
    return index, KVEventSubscriber(index, [ep], replay_timeout=3.0)


def _held(index: MemoryFleetIndex, ns: Namespace, tokens: list[int] = TOKENS) -> tuple[int, int]:
    """(blocks, GPU blocks) of ``tokens`` the replica holds in the index."""
    digests = BlockHasher(P).hash_prompt(tokens, ns)
    for m in index.match(digests):
        if m.replica == "pod":
            return m.blocks, m.gpu_blocks
    return 0, 0


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, **kw}
    return BlockStored(hashes, parent, tokens, P, **fields)


class FakeVllmReplay:
    """A replay endpoint as vLLM 0.33's ZmqEventPublisher serves it: a bound ROUTER that reads
    ``(identity, b"", start seq)`` and answers ``(identity, b"", topic, seq, payload)`` per
    buffered batch from ``start`` on, then ``(identity, b"", b"", END_SEQ, b"")``."""

    def __init__(self, buffered: list[tuple[int, bytes]], topic: bytes = b"") -> None:
        self.buffered = buffered
        self.topic = topic
        self.requests: list[int] = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            frame = self.sock.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_bytes = frame
            start = int.from_bytes(start_bytes, "big")
            self.requests.append(start)
            for seq, buf in self.buffered:
                if seq >= start:
                    self.sock.send_multipart(
                        (client_id, b"", self.topic, seq.to_bytes(8, "big"), buf)
                    )
            self.sock.send_multipart((client_id, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


# ---- 1. replay framing -----------------------------------------------------------------------


def test_a_gap_is_filled_from_a_vllm_style_replay_endpoint() -> None:
    first = _stored([11], None, TOKENS[:P])
    second = _stored([12], 11, TOKENS[P:])
    third = BlockRemoved([12], "GPU")
    server = FakeVllmReplay([(0, vllm_payload(first)), (1, vllm_payload(second))], topic=b"kv")
    try:
        index, sub = _subscriber(server.endpoint)
        sub.ingest("pod", 0, vllm_payload(first))
        assert _held(index, Namespace("llama")) == (1, 1)
        # batch 1 was missed: the subscriber asks for it and applies it before batch 2
        sub.ingest("pod", 2, vllm_payload(_stored([13], 11, [7, 7, 7, 7]), third))
        c = sub.counters()["pod"]
        assert server.requests == [1]
        assert (c.gaps, c.replays, c.cleared, c.malformed) == (1, 1, 0, 0)
        assert c.batches == 3
        assert _held(index, Namespace("llama")) == (1, 1)  # 12 came by replay, then went
        assert _held(index, Namespace("llama"), TOKENS[:P] + [7, 7, 7, 7]) == (2, 2)
    finally:
        server.close()


def test_a_vllm_style_dealer_reads_the_publishers_replay_answers() -> None:
    mgr = CacheManager(64, P)
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv") as pub:
        pub.attach(mgr)
        for k in range(3):
            mgr.admit(f"r{k}", [k] * P)
            mgr.end_step()
            pub.flush()
        assert pub.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            got = []
            while True:
                assert dealer.poll(TIMEOUT_MS), "no replay answer"
                frames = dealer.recv_multipart()
                assert len(frames) == 4 and frames[0] == b""
                _, topic, seq, payload = frames
                if seq == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    break
                assert topic == b"kv"
                got.append((int.from_bytes(seq, "big"), VLLM_DECODER.decode(payload)))
        finally:
            dealer.close(linger=0)
    assert [(s, b.events[0].token_ids) for s, b in got] == [(1, [1] * P), (2, [2] * P)]


# ---- 2. the publisher's default bytes --------------------------------------------------------


def _published(mgr: CacheManager, pub: KVEventPublisher, sock: zmq.Socket) -> bytes:
    seq = pub.flush()
    assert seq is not None
    while True:
        assert sock.poll(TIMEOUT_MS), "no message"
        topic, seq_frame, payload = sock.recv_multipart()
        if int.from_bytes(seq_frame, "big") == seq:
            assert topic == b""
            return payload


def test_the_publishers_default_bytes_decode_with_vllm_033_structs() -> None:
    mgr = CacheManager(64, P)
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        pub.attach(mgr)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pub.endpoint)
        try:
            for _ in range(200):  # PUB drops messages until the SUB is connected
                mgr.reset()
                pub.flush()
                if sock.poll(25):
                    while sock.poll(50):
                        sock.recv_multipart()
                    break
            lora = Namespace("llama", adapter="sql", salt="tenant-a")
            mgr.admit("a", list(range(10)), lora)
            mgr.admit("b", list(range(8)) + [99, 98, 97, 96], lora)
            mgr.admit("c", [5] * P)  # base model, no salt
            mgr.end_step()
            payload = _published(mgr, pub, sock)
            raw = msgspec.msgpack.decode(payload)
            assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
            batch = VLLM_DECODER.decode(payload)
            assert batch.data_parallel_rank == 0
            first, second, plain = batch.events
            assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
            assert first.parent_block_hash is None and first.token_ids == list(range(8))
            assert first.medium == "GPU" and first.lora_name == "sql"
            assert isinstance(first.lora_id, int) and first.lora_id > 0
            assert second.lora_id == first.lora_id
            # per block: the LoRA name, then cache_salt on the block at token 0
            assert first.extra_keys == [("sql", "tenant-a"), ("sql",)]
            assert second.parent_block_hash == first.block_hashes[1]
            assert second.extra_keys == [("sql",)]
            assert isinstance(plain, BlockStored) and plain.extra_keys is None
            assert (plain.lora_id, plain.lora_name) == (None, None)
            # required fields are always there, optional ones omitted when None
            stored = raw[1][2]
            assert set(stored) == {
                "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "lora_id", "medium", "lora_name",
            }  # fmt: skip
            mgr.release("b")
            mgr.evict(1)
            payload = _published(mgr, pub, sock)
            assert [type(e) for e in VLLM_DECODER.decode(payload).events] == [BlockRemoved]
            assert set(msgspec.msgpack.decode(payload)[1][0]) == {"type", "block_hashes", "medium"}
        finally:
            sock.close(linger=0)


def test_the_publishers_namespace_round_trips_through_the_subscriber() -> None:
    """What the publisher sends lands under the namespace a routed request hashes to: the
    adapter and salt from the wire, as vLLM sends them, the adapter version and extra keys
    (which vLLM has no key for) from the replica's configured namespace."""
    mgr = CacheManager(64, P)
    events: list[Any] = []
    mgr.add_listener(events.append)
    ns = Namespace("llama", adapter="sql", adapter_version="v2", salt="t", extra=("x",))
    mgr.admit("a", TOKENS, ns)
    mgr.end_step()
    payload = kv_wire.encode_batch(
        kv_wire.KVEventBatch(1.0, [to_wire(e) for e in events], 0), kv_wire.WireLayout.MAP_EVENTS
    )
    assert VLLM_DECODER.decode(payload).events[0].extra_keys[0][:2] == ("sql", "t")
    # exactly vLLM's keys: the LoRA name per block, cache_salt on the first; nothing more
    assert VLLM_DECODER.decode(payload).events[0].extra_keys == [("sql", "t"), ("sql",)]
    index = MemoryFleetIndex()
    configured = Namespace("llama", adapter="sql", adapter_version="v2", extra=("x",))
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod", None, None, configured, P)])
    sub.ingest("pod", 0, payload)
    assert _held(index, ns) == (2, 2)
    assert _held(index, Namespace("llama", adapter="sql", adapter_version="v2", salt="t")) == (0, 0)


def test_extra_keys_are_what_vllm_033_sends_for_every_namespace() -> None:
    """Per block vLLM 0.33 sends the LoRA name, then cache_salt on the block at token 0 when it
    is not empty (``generate_block_hash_extra_keys`` through ``to_event_extra_keys``); the
    adapter version and extra keys change the block hashes, never the keys."""
    cases = [  # (namespace, keys of a chain's first run, keys of the run stored under it)
        (Namespace("llama"), None, None),
        (Namespace("llama", salt="t"), [("t",), None], None),
        (Namespace("llama", adapter="sql"), [("sql",), ("sql",)], [("sql",)]),
        (Namespace("llama", adapter="sql", salt="t"), [("sql", "t"), ("sql",)], [("sql",)]),
        (Namespace("llama", adapter_version="3", extra=("x", "y")), None, None),
        (
            Namespace("llama", adapter="sql", adapter_version="3", salt="t", extra=("x",)),
            [("sql", "t"), ("sql",)],
            [("sql",)],
        ),
    ]
    for ns, first_keys, next_keys in cases:
        mgr = CacheManager(64, P)
        events: list[Any] = []
        mgr.add_listener(events.append)
        mgr.admit("a", TOKENS, ns)
        mgr.end_step()
        mgr.admit("b", TOKENS + [7] * P, ns)  # one more block, under the first two
        mgr.end_step()
        payload = kv_wire.encode_batch(kv_wire.KVEventBatch(1.0, [to_wire(e) for e in events], 0))
        first, following = VLLM_DECODER.decode(payload).events
        assert first.extra_keys == first_keys, ns
        assert following.parent_block_hash == first.block_hashes[-1]
        assert following.extra_keys == next_keys, ns


# ---- 3. media and placeholder stores ---------------------------------------------------------


def _placeholder(hashes: list[int], medium: str) -> BlockStored:
    """vLLM's offload connectors announce an offloaded block without its metadata this way."""
    return BlockStored(hashes, None, [], 0, None, medium, None, locality="LOCAL")


def test_offload_placeholders_keep_blocks_routable_per_medium() -> None:
    index, sub = _subscriber()
    ns = Namespace("llama")
    sub.ingest("pod", 0, vllm_payload(_stored([11, 12], None, TOKENS)))
    sub.ingest("pod", 1, vllm_payload(_placeholder([11, 12], "STORAGE")))
    sub.ingest("pod", 2, vllm_payload(_placeholder([11], "cpu")))  # Mooncake's store connector
    sub.ingest("pod", 3, vllm_payload(BlockRemoved([11, 12], "GPU")))
    assert _held(index, ns) == (2, 0)  # off the GPU, still routable
    sub.ingest("pod", 4, vllm_payload(BlockRemoved([11], "CPU")))
    assert _held(index, ns) == (2, 0)  # block 11 is still in storage
    sub.ingest("pod", 5, vllm_payload(BlockRemoved([11, 12], "STORAGE")))
    assert _held(index, ns) == (0, 0)
    c = sub.counters()["pod"]
    assert (c.malformed, c.blocks_stored) == (0, 5)
    assert sub.ingest_counts()["pod"].errors == 0


def test_sglang_hicache_host_copies_and_unknown_media_are_kept() -> None:
    index, sub = _subscriber()
    ns = Namespace("llama")
    sub.ingest("pod", 0, sglang_payload(SglBlockStored([-5, 6], None, TOKENS, P, None, "GPU")))
    sub.ingest(
        "pod", 1, sglang_payload(SglBlockStored([-5, 6], None, TOKENS, P, None, "CPU_PINNED"))
    )
    sub.ingest("pod", 2, sglang_payload(SglBlockStored([-5], None, TOKENS[:P], P, None, "Disk")))
    sub.ingest("pod", 3, sglang_payload(SglBlockRemoved([-5, 6], "GPU")))
    assert _held(index, ns) == (2, 0)
    sub.ingest("pod", 4, sglang_payload(SglBlockRemoved([-5, 6], "cpu_pinned")))
    assert _held(index, ns) == (1, 0)  # block -5 is still on "DISK"
    sub.ingest("pod", 5, sglang_payload(SglBlockRemoved([-5], "DISK")))
    assert _held(index, ns) == (0, 0)
    assert sub.counters()["pod"].malformed == 0


# ---- 4. SGLang's cache_salt ------------------------------------------------------------------


def test_sglangs_cache_salt_puts_blocks_in_the_salted_namespace() -> None:
    from prefixcache.fleet.replica_spec import ReplicaSpec
    from prefixcache.fleet.router import Router

    index, sub = _subscriber()
    first = SglBlockStored([-7], None, TOKENS[:P], P, None, "GPU", cache_salt="tenant-a")
    rest = SglBlockStored([8], -7, TOKENS[P:], P, None, "GPU", cache_salt="tenant-a")
    sub.ingest("pod", 0, sglang_payload(first, rest))
    assert sub.counters()["pod"].malformed == 0
    router = Router(index, [ReplicaSpec("pod", Namespace("llama"), P)])

    def cached(ns: Namespace) -> int:
        return {s.name: s.cached_tokens for s in router.lookup(ns, TOKENS).scores}.get("pod", 0)

    assert cached(Namespace("llama", salt="tenant-a")) == 2 * P
    assert cached(Namespace("llama")) == 0
    assert cached(Namespace("llama", salt="tenant-b")) == 0


# ---- 6. the subscriber's maximum message size ------------------------------------------------


def test_a_message_over_the_size_limit_is_dropped_and_the_stream_goes_on() -> None:
    from tests.fleet_support import wait_until

    index = MemoryFleetIndex()
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        ep = ReplicaEndpoint("pod", pub.endpoint, None, Namespace("llama"), P)
        sub = KVEventSubscriber(index, [ep], max_message_bytes=4096)
        with sub:

            def arrived(payload: bytes) -> bool:
                """Publish ``payload``; whether it came in within 0.2 s."""
                before = sub.counters()["pod"].batches
                pub.publish_payload(payload)
                deadline = time.monotonic() + 0.2
                while time.monotonic() < deadline:
                    if sub.counters()["pod"].batches > before:
                        return True
                    time.sleep(0.01)
                return False

            wait_until(lambda: arrived(vllm_payload(AllBlocksCleared())), what="connected")
            big = vllm_payload(_stored([11], None, [3] * P), AllBlocksCleared()) + b"\x00" * 8192
            oversized = pub.publish_payload(big)  # would be malformed if it came in
            wait_until(
                lambda: arrived(vllm_payload(_stored([11, 12], None, TOKENS))),
                what="the stream going on",
            )
            c = sub.counters()["pod"]
            assert c.malformed == 0 and c.last_seq > oversized
            assert _held(index, Namespace("llama")) == (2, 2)
    with pytest.raises(Exception, match="max_message_bytes"):
        KVEventSubscriber(index, [], max_message_bytes=0)
