"""KV events on the wire: the publisher's bytes against an independent copy of vLLM's structs,
real PUB/ROUTER sockets, and the decoder's layouts and errors."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from fleet_support import manager_digests
from vllm_structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, MapKVEventBatch

from prefixcache import CacheManager, Namespace
from prefixcache.errors import ConfigError, WireFormatError
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.publisher import KVEventPublisher, PublisherClosedError


# The layout before events became maps (and SGLang's): tagged arrays.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[LegacyStored | LegacyRemoved]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)  # vLLM 0.33's own decoder
TIMEOUT_MS = 5000


def _sub(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "no message"
    return sock.recv_multipart()


def _connected(pub: KVEventPublisher, sub: zmq.Socket, mgr: CacheManager) -> None:
    """PUB drops messages until the SUB is connected: send probes until one arrives."""
    for _ in range(200):
        mgr.reset()  # an AllBlocksCleared each time
        pub.flush()
        if sub.poll(25):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never connected")


@pytest.fixture
def rig():
    mgr = CacheManager(64, 4)
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    pub.attach(mgr)
    sub = _sub(pub.endpoint)
    _connected(pub, sub, mgr)
    yield mgr, pub, sub
    sub.close(linger=0)
    pub.close()


def test_publisher_bytes_decode_with_vllm_structs(rig):
    mgr, pub, sub = rig
    ns = Namespace("llama", adapter="sql", salt="tenant-a")
    mgr.admit("a", list(range(10)), ns)
    mgr.admit("b", list(range(8)) + [99, 98, 97, 96], ns)
    mgr.end_step()
    seq = pub.flush()
    topic, seq_frame, payload = _recv(sub)
    assert topic == b"kv"
    assert seq_frame == seq.to_bytes(8, "big") and len(seq_frame) == 8
    batch = VLLM.decode(payload)
    assert batch.data_parallel_rank == 0
    first, second = batch.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and len(first.block_hashes) == 2
    assert first.token_ids == list(range(8)) and first.block_size == 4
    assert first.medium == "GPU" and first.lora_name == "sql" and first.lora_id is not None
    assert first.extra_keys == [("sql", "tenant-a"), ("sql",)]
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == [99, 98, 97, 96] and second.extra_keys == [("sql",)]
    assert set(first.block_hashes + second.block_hashes) == manager_digests(mgr)
    assert all(isinstance(h, bytes) and len(h) == 16 for h in first.block_hashes)
    # the raw shape: an array batch of tagged maps
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0]["type"] == "BlockStored"

    mgr.release("b")
    mgr.evict(1)
    pub.flush()
    removed = VLLM.decode(_recv(sub)[2]).events
    assert removed == [BlockRemoved(block_hashes=second.block_hashes, medium="GPU")]


def test_vllm_encoded_bytes_decode_with_ours():
    ours = kv_wire.BatchDecoder()
    stored = BlockStored([7, b"\x01" * 16], 3, list(range(8)), 4, None, "CPU", "lora", [None, None])
    payload = msgspec.msgpack.encode(
        MapKVEventBatch(1.5, [stored, BlockRemoved([7], "GPU"), AllBlocksCleared()], 2)
    )
    got = ours.decode(payload)
    assert got.layout is kv_wire.WireLayout.MAP and got.ts == 1.5 and got.data_parallel_rank == 2
    assert got.events == [
        kv_wire.StoredBlocks(
            [7, b"\x01" * 16], 3, list(range(8)), 4, "CPU", "lora", [None, None], None
        ),
        kv_wire.RemovedBlocks([7], "GPU", None),
        kv_wire.ClearedAll(),
    ]
    legacy = msgspec.msgpack.encode(LegacyBatch(2.0, [LegacyStored([1], None, [1, 2], 2, None)]))
    got = ours.decode(legacy)
    assert got.layout is kv_wire.WireLayout.ARRAY and got.data_parallel_rank is None
    assert got.events == [kv_wire.StoredBlocks([1], None, [1, 2], 2, None, None, None, None)]


def _engine_payload(layout: kv_wire.WireLayout) -> bytes:
    """A stored and a removed block in ``layout``, written with the engine's own structs: vLLM
    0.33's (array batch, map events), vLLM's at commit 0181ea3 (all maps), older vLLM's and
    SGLang's (all arrays, no rank)."""
    stored = BlockStored([b"a" * 16], None, [5, 6], 2, None, "GPU", None)
    removed = BlockRemoved([b"a" * 16], "GPU")
    if layout is kv_wire.WireLayout.MAP_EVENTS:
        return msgspec.msgpack.encode(KVEventBatch(3.0, [stored, removed], 1))
    if layout is kv_wire.WireLayout.MAP:
        return msgspec.msgpack.encode(MapKVEventBatch(3.0, [stored, removed], 1))
    legacy = [LegacyStored([5], None, [5, 6], 2, None), LegacyRemoved([5])]
    return msgspec.msgpack.encode(LegacyBatch(3.0, legacy))


@pytest.mark.parametrize("layout", list(kv_wire.WireLayout))
def test_every_layout_an_engine_sends_decodes(layout):
    payload = _engine_payload(layout)
    got = kv_wire.decode_batch(payload)
    ranked = layout is not kv_wire.WireLayout.ARRAY  # the all-array batch has no rank
    assert got.layout is layout and got.data_parallel_rank == (1 if ranked else None)
    assert [type(e) for e in got.events] == [kv_wire.StoredBlocks, kv_wire.RemovedBlocks]
    if layout is kv_wire.WireLayout.ARRAY:
        assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"
    if layout is kv_wire.WireLayout.MAP_EVENTS:
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored"


def test_only_the_layout_vllm_033_reads_is_sent():
    batch = kv_wire.KVEventBatch(
        3.0,
        [
            kv_wire.WireBlockStored([b"a" * 16], None, [5, 6], 2, None, "GPU", None),
            kv_wire.WireBlockRemoved([b"a" * 16], "GPU"),
            kv_wire.WireAllBlocksCleared(),
        ],
        1,
    )
    payload = kv_wire.encode_batch(batch)
    assert payload == msgspec.msgpack.encode(
        KVEventBatch(
            3.0,
            [
                BlockStored([b"a" * 16], None, [5, 6], 2, None, "GPU", None),
                BlockRemoved([b"a" * 16], "GPU"),
                AllBlocksCleared(),
            ],
            1,
        )
    )  # byte for byte what vLLM 0.33 sends for these events
    assert VLLM.decode(payload).events[1] == BlockRemoved([b"a" * 16], "GPU")
    assert kv_wire.decode_batch(payload).layout is kv_wire.WireLayout.MAP_EVENTS
    for layout in (kv_wire.WireLayout.MAP, kv_wire.WireLayout.ARRAY):
        with pytest.raises(WireFormatError, match="read, not sent"):
            kv_wire.encode_batch(batch, layout)
        with pytest.raises(ConfigError, match="MAP_EVENTS"):
            KVEventPublisher("tcp://127.0.0.1:*", layout=layout)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"ts": "x"}),
        msgspec.msgpack.encode([1.0, [["Nope"]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    ],
)
def test_malformed_payloads_raise_typed_errors(payload):
    with pytest.raises(WireFormatError):
        kv_wire.decode_batch(payload)
    with pytest.raises(WireFormatError):
        kv_wire.decode_seq(b"\x00" * 7)


def test_replay_serves_buffered_batches_then_the_end_marker(rig):
    mgr, pub, _ = rig
    start = pub.next_seq
    for k in range(3):
        mgr.admit(f"r{k}", [k] * 4)
        mgr.end_step()
        pub.flush()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart((b"", (start + 1).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(TIMEOUT_MS)
            _, topic, seq, payload = dealer.recv_multipart()
            assert topic == (b"" if seq == kv_wire.END_SEQ else b"kv")
            if seq == kv_wire.END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), VLLM.decode(payload).events[0].token_ids))
        assert got == [(start + 1, [1] * 4), (start + 2, [2] * 4)]
    finally:
        dealer.close(linger=0)


def test_replay_buffer_is_bounded_and_close_is_final():
    mgr = CacheManager(16, 2)
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2) as pub:
        pub.attach(mgr)
        assert pub.flush() is None  # nothing queued
        for k in range(5):
            mgr.admit(k, [k, k])
            assert pub.flush() == k
        assert [s for s, _ in pub._buffer] == [3, 4]
    with pytest.raises(PublisherClosedError):
        pub.flush()
    with pytest.raises(ConfigError):
        KVEventPublisher("tcp://127.0.0.1:*", buffer_steps=0)
    with pytest.raises(ConfigError):
        KVEventPublisher("bogus://nowhere")
