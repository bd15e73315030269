"""A router that starts late, restarts past the replay buffer, misses batches nobody can replay,
or gets a batch twice or out of order still finds every prefix a replica holds: blocks stored
under a parent it never saw are kept (``unplaced``) and placed by the engine's own block hashes
(``engine_keys``) or by a prompt routed to the replica. Replicas are modelled on vLLM's prefix
cache (``VllmModel``) and publish over real ZMQ sockets; each test ends with every lookup equal
to what the model holds, and nothing the model dropped still counted."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from vllm_structs import BlockRemoved, BlockStored, KVEventBatch

from prefixcache import Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.events.engine_keys import (
    EngineHasher,
    EngineHashSpec,
    cbor_encode,
    parse_engine_hash,
)
from prefixcache.fleet.events.publisher import KVEventPublisher
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.router import Router
from tests.fleet_support import wait_until

P = 4
NS = Namespace("llama")
SHA_CBOR = EngineHashSpec("vllm", "sha256_cbor", "0")


# ---- the engine's hashes, against values computed by vLLM 0.33's own code ------------------


def test_vllm_block_hashes_equal_the_engines_reference_values() -> None:
    tokens = list(range(1, 33))
    cbor = EngineHasher(EngineHashSpec("vllm", "sha256_cbor"), 16)
    assert cbor.block_hashes(tokens) == [8866452693264111234, 807986237951177663]
    raw = EngineHasher(EngineHashSpec("vllm", "sha256_cbor", int_hashes=False), 16)
    first, second = raw.block_hashes(tokens)
    assert isinstance(first, bytes) and isinstance(second, bytes)
    assert first.hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    assert second.hex().startswith("2533ea50") and second.hex().endswith("d87bf3bf")
    pickled = EngineHasher(EngineHashSpec("vllm", "sha256"), 16)
    assert pickled.block_hashes(tokens)[0] == 1403909460543360175
    # the seed is PYTHONHASHSEED's value when the engine sets it
    seeded = EngineHasher(EngineHashSpec("vllm", "sha256_cbor", "0"), 16)
    assert seeded.block_hashes(tokens)[0] != 8866452693264111234
    for algo in ("xxhash", "xxhash_cbor"):
        h = EngineHasher(EngineHashSpec("vllm", algo, "0"), 16).block_hashes(tokens)
        assert len(h) == 2 and all(0 <= x < 1 << 64 for x in h)


def test_sglang_page_hashes_and_cache_salt() -> None:
    sgl = EngineHasher(EngineHashSpec("sglang", "sha256"), 4)
    assert sgl.block_hashes(list(range(1, 9))) == [-3488128144981237669, 5674439469042975057]
    salted = sgl.block_hashes(list(range(1, 9)), salt="t")
    assert salted[0] != -3488128144981237669 and len(salted) == 2


def test_sglang_eagle_page_hashes_equal_the_engines_reference_values() -> None:
    """SGLang with EAGLE hashes bigram pages: values computed by SGLang 0.5.23's own native
    page hash (``hash_binding.cpp``, built from the wheel) over raw tokens 1..17, pages of 4."""
    eagle = EngineHasher(parse_engine_hash("sglang-eagle"), 4)  # type: ignore[arg-type]
    tokens = list(range(1, 18))  # 16 bigrams: 4 full pages
    plain = [-638950109823820341, -4369944537645631836, -1554502205858632688, -3367001684096184181]
    assert eagle.block_hashes(tokens) == plain
    assert eagle.block_hashes(tokens, salt="tenant-a") == [
        2832294365426534333,
        3603037882432405245,
        -6308801566115877871,
        6012705935904633126,
    ]
    assert eagle.block_hashes(tokens[:16]) == plain[:3]  # the last page lacks its next token
    first = eagle.digests(tokens, limit=2)
    rest = eagle.digests(tokens, start=2, parent=first[-1])
    assert [eagle.event_form(d) for d in first + rest] == plain


def test_an_sglang_eagle_replica_is_found_by_its_engine_hashes() -> None:
    """Pages stored under a parent the router never saw, sent as SGLang's bigram pairs, are
    found by a lookup of the prompt (its engine hashes), prefix included."""
    eagle = EngineHasher(parse_engine_hash("sglang-eagle"), P)  # type: ignore[arg-type]
    tokens = list(range(40, 40 + 4 * P + 1))
    hashes = eagle.block_hashes(tokens)
    pairs = [[tokens[j], tokens[j + 1]] for j in range(2 * P, 3 * P)]  # page 2 only
    stored = {
        "type": "BlockStored",
        "block_hashes": [hashes[2]],
        "parent_block_hash": hashes[1],
        "token_ids": pairs,
        "block_size": P,
        "lora_id": None,
        "medium": "GPU",
    }
    index = MemoryFleetIndex()
    ep = ReplicaEndpoint("pod", None, None, NS, P, engine_hash=eagle.spec)
    sub = KVEventSubscriber(index, [ep])
    router = Router(index, [ReplicaSpec("pod", NS, P)], held=sub.unplaced)
    assert sub.ingest("pod", 3, msgspec.msgpack.encode([1.0, [stored], 0])) == 1
    assert sub.counters()["pod"].unplaced == 1
    assert _cached(router, tokens) == 3  # pages 0-1 vouched for by page 2
    assert _cached(router, tokens[: 2 * P + 1]) == 2


def test_eagle_engine_hashes_follow_the_token_after_each_page() -> None:
    """Two prompts with the same full blocks but another token after them have other EAGLE
    hashes for their last page: a lookup never reuses the first prompt's."""
    from prefixcache.blocks.hashing import BlockHasher

    eagle = EngineHasher(parse_engine_hash("sglang-eagle"), P)  # type: ignore[arg-type]
    ep = ReplicaEndpoint("pod", None, None, NS, P, engine_hash=eagle.spec)
    sub = KVEventSubscriber(MemoryFleetIndex(), [ep])
    rep = sub._replicas["pod"]
    assert rep.engine is not None
    first = list(range(50, 50 + 2 * P)) + [7]
    second = first[:-1] + [8]
    for tokens in (first, second, first, first[:-1]):
        digests = BlockHasher(P).hash_prompt(tokens, NS)
        arr = np.asarray(tokens, dtype=np.int32)
        got, _ = sub.unplaced._engine_hashes(rep.engine, NS, arr, digests)
        assert got == eagle.block_hashes(tokens), tokens[-1]


def test_cache_salt_and_lora_keys_change_only_what_the_engine_changes() -> None:
    spec = EngineHashSpec("vllm", "sha256_cbor", lora_paths={"sql": "/adapters/sql"})
    h = EngineHasher(spec, P)
    tokens = list(range(12))
    plain, salted = h.block_hashes(tokens), h.block_hashes(tokens, salt="a")
    assert all(x != y for x, y in zip(plain, salted, strict=True))  # chained from block 0
    lora = h.block_hashes(tokens, adapter="sql")
    assert all(x != y for x, y in zip(plain, lora, strict=True))
    assert h.block_hashes(tokens, adapter="unknown-path") == []  # its path is not configured
    assert not h.supports(None, ('["mm", "img", 0]',))


def test_canonical_cbor_matches_cbor2() -> None:
    cbor2 = pytest.importorskip("cbor2")
    for obj in [
        (b"\x01" * 32, (0, 23, 24, 255, 256, 65535, 65536, 1 << 32), None),
        (b"", (), (("lora", "a", "/p"), ("cache_salt", "s"))),
        "vllm-none-hash",
        (-1, -24, -25, -300),
        ("mm", "img", -3),
    ]:
        assert cbor_encode(obj) == cbor2.dumps(obj, canonical=True), obj


def test_engine_hash_settings_are_checked() -> None:
    assert parse_engine_hash("vllm-sha256_cbor") == EngineHashSpec("vllm", "sha256_cbor")
    assert parse_engine_hash({"algo": "xxhash_cbor", "seed": 0}).seed == "0"  # type: ignore[union-attr]
    assert parse_engine_hash("sglang") == EngineHashSpec("sglang", "sha256")
    assert parse_engine_hash("sglang-eagle") == EngineHashSpec("sglang", "sha256", eagle=True)
    assert parse_engine_hash({"engine": "sglang", "eagle": True}).label() == "sglang-eagle"  # type: ignore[union-attr]
    bad_specs = ("vllm-md5", "vllm-xxhash", {"engine": "trt"}, {"algo": "sha256", "x": 1}, 3)
    for bad in (*bad_specs, {"engine": "vllm", "eagle": True}, {"engine": "sglang", "eagle": 1}):
        with pytest.raises(ConfigError):
            parse_engine_hash(bad)


# ---- a model of vLLM's prefix cache, publishing over ZMQ ------------------------------------


class VllmModel:
    """vLLM's prefix cache as its events show it: full blocks keyed by chained hashes, evicted
    least recently used, a request's blocks freed tail first (a block's ancestors outlive it).
    One batch per served request, published with a replay buffer of ``buffer_steps``."""

    def __init__(self, capacity: int, buffer_steps: int = 3) -> None:
        self.capacity = capacity
        self.hasher = EngineHasher(SHA_CBOR, P)
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.pub = KVEventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps
        )

    def serve(self, tokens: list[int]) -> None:
        hashes = self.hasher.block_hashes(tokens)
        k = self.held(tokens)
        events: list[Any] = []
        keep = set(hashes[:k])
        while len(self.cache) + len(hashes) - k > self.capacity:
            victim = next(h for h in self.cache if h not in keep)
            del self.cache[victim]
            events.append(BlockRemoved([victim], "GPU"))
        if k < len(hashes):
            parent = hashes[k - 1] if k else None
            body = tokens[k * P : len(hashes) * P]
            events.append(BlockStored(hashes[k:], parent, body, P, None, "GPU", None))
            for h in hashes[k:]:
                self.cache[h] = None
        for h in reversed(hashes):  # freed tail first: the leaf goes before its ancestors
            self.cache.move_to_end(h)
        if events:
            self.publish(events)

    def publish(self, events: list[Any]) -> int:
        batch = KVEventBatch(time.time(), events, 0)
        return self.pub.publish_payload(msgspec.msgpack.encode(batch))

    def held(self, tokens: list[int]) -> int:
        """The engine's own answer: the leading blocks of ``tokens`` in its cache."""
        n = 0
        for h in self.hasher.block_hashes(tokens):
            if h not in self.cache:
                break
            n += 1
        return n


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three shared prefixes of 4 blocks, and prompts extending each by 2 blocks."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(4 * P)] for _ in range(3)]
    longer = [p + [rng.randrange(1000) for _ in range(2 * P)] for p in prefixes]
    return prefixes, longer


def _router(
    engine: VllmModel, engine_hash: EngineHashSpec | None, *, follow: bool = True
) -> tuple[MemoryFleetIndex, KVEventSubscriber, Router]:
    index = MemoryFleetIndex()
    ep = ReplicaEndpoint(
        "pod",
        engine.pub.endpoint if follow else None,
        engine.pub.replay_endpoint,
        NS,
        P,
        engine_hash=engine_hash,
    )
    sub = KVEventSubscriber(index, [ep], replay_timeout=2.0)
    router = Router(index, [ReplicaSpec("pod", NS, P)], held=sub.unplaced)
    return index, sub, router


def _connect(engine: VllmModel, sub: KVEventSubscriber) -> None:
    """Start the subscriber; wait until it hears the engine (the PUB drops messages before)."""
    sub.start()

    def heard() -> bool:
        engine.publish([])
        time.sleep(0.02)
        return sub.counters()["pod"].batches > 0

    wait_until(heard, what="the subscriber connected")


def _synced(engine: VllmModel, sub: KVEventSubscriber) -> None:
    wait_until(lambda: sub.counters()["pod"].last_seq == engine.pub.next_seq - 1, what="synced")


def _cached(router: Router, tokens: list[int]) -> int:
    scores = {s.name: s.cached_tokens for s in router.lookup(NS, tokens).scores}
    return scores["pod"] // P


def _assert_exact(engine: VllmModel, router: Router, prompts: list[list[int]]) -> None:
    assert [_cached(router, t) for t in prompts] == [engine.held(t) for t in prompts]


# ---- late join, router restart ----------------------------------------------------------------


def test_a_router_started_late_finds_every_prefix_by_engine_keys() -> None:
    engine = VllmModel(capacity=64)
    prefixes, longer = _prompts(1)
    others = [p[: 2 * P] + [7] * (3 * P) for p in prefixes]  # share 2 blocks with a prefix
    try:
        for t in prefixes:
            engine.serve(t)
        for k in range(4):  # past the replay buffer (3 batches)
            engine.serve([900 + k] * P)
        index, sub, router = _router(engine, SHA_CBOR)
        _connect(engine, sub)
        assert [_cached(router, t) for t in prefixes] == [0, 0, 0]  # nothing seen yet
        for t in longer:  # one request per prefix: its new blocks name an unseen parent
            engine.serve(t)
        _synced(engine, sub)
        assert [engine.held(t) for t in longer] == [6, 6, 6]
        _assert_exact(engine, router, longer + prefixes + others)
        c = sub.counters()["pod"]
        assert c.malformed == 0 and c.unplaced == 6 and c.placed_late >= 18
        assert [m.blocks for m in index.match(router._hashers[P].hash_prompt(longer[0], NS))] == [6]
        # evictions (tail first) of blocks placed by the lookups and of ones never seen
        for k in range(40):
            engine.serve([500 + k] * (2 * P))
        _synced(engine, sub)
        _assert_exact(engine, router, longer + prefixes + others)
        sub.stop()
    finally:
        engine.pub.close()


def test_a_restarted_router_past_the_replay_buffer_holds_no_stale_block() -> None:
    engine = VllmModel(capacity=24)
    prefixes, longer = _prompts(2)
    try:
        _, sub, router = _router(engine, SHA_CBOR)
        _connect(engine, sub)
        for t in prefixes:
            engine.serve(t)
        _synced(engine, sub)
        _assert_exact(engine, router, prefixes)
        sub.stop()  # the router goes away; the engine goes on past its replay buffer
        for t in longer:
            engine.serve(t)
        for k in range(5):
            engine.serve([800 + k] * (2 * P))  # evicts some of the blocks
        _, sub, router = _router(engine, SHA_CBOR)  # a fresh in-memory index
        _connect(engine, sub)
        for t in longer:  # one request per prefix
            engine.serve(t)
        _synced(engine, sub)
        assert any(engine.held(t) for t in longer)
        _assert_exact(engine, router, longer + prefixes)
        # an unplaced block evicted before any lookup placed it leaves no stale entry
        for k in range(10):
            engine.serve([300 + k] * (2 * P))
        _synced(engine, sub)
        _assert_exact(engine, router, longer + prefixes)
        sub.stop()
    finally:
        engine.pub.close()


def test_without_engine_keys_a_routed_request_places_what_its_replica_stored() -> None:
    engine = VllmModel(capacity=64)
    prefixes, longer = _prompts(3)
    try:
        for t in prefixes:
            engine.serve(t)
        for k in range(4):
            engine.serve([900 + k] * P)
        _, sub, router = _router(engine, None)
        _connect(engine, sub)
        for k, t in enumerate(longer):
            assert router.route(NS, t, f"r{k}").replica == "pod"
            engine.serve(t)  # the routed request's new blocks: parent unseen, tokens known
        _synced(engine, sub)
        _assert_exact(engine, router, longer + prefixes)
        # a removal of a block never seen may be one indexed without its hash: they go
        engine.serve([1] * (62 * P))
        _synced(engine, sub)
        for t in longer + prefixes:
            assert _cached(router, t) <= engine.held(t)  # never stale
        sub.stop()
    finally:
        engine.pub.close()


# ---- batches lost, repeated, swapped (fed from a real SUB socket) -------------------------


def _listen(engine: VllmModel) -> zmq.Socket[Any]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(engine.pub.endpoint)

    def heard() -> bool:
        engine.publish([])
        if sock.poll(20):
            while sock.poll(50):
                sock.recv_multipart()
            return True
        return False

    wait_until(heard, what="the SUB socket connected")
    return sock


def _take(sock: zmq.Socket[Any], n: int) -> list[tuple[int, bytes]]:
    out = []
    for _ in range(n):
        assert sock.poll(5000), "no message"
        _, seq, payload = sock.recv_multipart()
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def test_an_unfillable_gap_clears_then_one_request_per_prefix_places_them() -> None:
    engine = VllmModel(capacity=64)
    prefixes, longer = _prompts(4)
    try:
        _, sub, router = _router(engine, SHA_CBOR, follow=False)
        sock = _listen(engine)
        first = engine.pub.next_seq
        for t in prefixes:
            engine.serve(t)
        for k in range(5):
            engine.serve([700 + k] * P)
        got = _take(sock, 8)
        sub.ingest("pod", *got[0])  # then batches 1..6 are lost, 4 beyond the replay buffer
        assert got[0][0] == first
        sub.ingest("pod", *got[7])
        assert sub.counters()["pod"].cleared == 1
        for t in longer:
            engine.serve(t)
        for seq, payload in _take(sock, 3):
            sub.ingest("pod", seq, payload)
        _assert_exact(engine, router, longer + prefixes)
        sock.close(linger=0)
    finally:
        engine.pub.close()


def test_a_repeated_or_swapped_batch_changes_nothing() -> None:
    engine = VllmModel(capacity=64, buffer_steps=100)
    prefixes, longer = _prompts(5)
    try:
        _, sub, router = _router(engine, None, follow=False)
        sock = _listen(engine)
        for t in prefixes + longer:
            engine.serve(t)
        got = _take(sock, 6)
        order = [0, 1, 1, 3, 2, 4, 5, 5, 4]  # repeated; swapped (2 is replayed, then late)
        for k in order:
            sub.ingest("pod", *got[k])
        c = sub.counters()["pod"]
        assert (c.cleared, c.resets, c.late, c.malformed) == (0, 0, 4, 0)
        _assert_exact(engine, router, longer + prefixes)
        sock.close(linger=0)
    finally:
        engine.pub.close()


def test_a_replicas_engine_hash_is_read_from_the_service_config() -> None:
    from prefixcache.fleet.service.configuration.config_file import parse_config

    def replica(**kw: Any) -> dict[str, Any]:
        return {"replicas": [{"name": "a", "model": "llama", **kw}]}

    assert parse_config(replica()).replicas[0].engine_hash is None
    got = parse_config(replica(engine_hash="vllm-sha256_cbor")).replicas[0].engine_hash
    assert got == EngineHashSpec("vllm", "sha256_cbor")
    raw = {"engine": "vllm", "algo": "xxhash_cbor", "seed": 42, "lora_paths": {"sql": "/a/sql"}}
    got = parse_config(replica(engine_hash=raw)).replicas[0].engine_hash
    assert got == EngineHashSpec("vllm", "xxhash_cbor", "42", True, {"sql": "/a/sql"})
    with pytest.raises(ConfigError, match=r"replicas\[0\].*seed"):
        parse_config(replica(engine_hash="vllm-xxhash"))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_the_block_chain_is_vllms_hash_block_tokens_applied_block_by_block(algo: str) -> None:
    from prefixcache.fleet.events.engine_keys import vllm_hash

    spec = EngineHashSpec("vllm", algo, "7", lora_paths={"sql": "/a/sql"})
    tokens = [0, 23, 24, 255, 256, 65535, 65536, (1 << 31) - 1] * 3
    for adapter, salt in ((None, None), (None, "s"), (None, ""), ("sql", None), ("sql", "s")):
        lora = ("lora", "sql", "/a/sql") if adapter else None
        parent = vllm_hash(algo, "7")
        expected = []
        for i in range(3):
            keys = [lora] if lora else []
            if i == 0 and salt:  # an empty salt adds no key
                keys.append(("cache_salt", salt))
            block = tuple(tokens[8 * i : 8 * i + 8])
            parent = vllm_hash(algo, (parent, block, tuple(keys) if keys else None))
            expected.append(int.from_bytes(parent[-8:], "big"))
        got = EngineHasher(spec, 8).block_hashes(tokens, adapter=adapter, salt=salt)
        assert got == expected, (adapter, salt)


def test_the_service_looks_up_unplaced_blocks_by_the_configured_engine_hash() -> None:
    """``engine_hash`` in a replica's config reaches the subscriber, and the service's lookups
    count what the replica stored under a parent the service never saw."""
    from fastapi.testclient import TestClient

    from prefixcache.fleet.service.assembly import build_service
    from prefixcache.fleet.service.configuration.config_file import parse_config

    entry = {"name": "a", "model": "llama", "block_size": P, "engine_hash": "vllm-sha256_cbor"}
    config = parse_config({"replicas": [entry, {**entry, "name": "b", "engine_hash": None}]})
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(
        index, [ReplicaEndpoint(r.name, namespace=NS, block_size=P) for r in config.replicas]
    )
    tokens = list(range(10, 10 + 5 * P))
    hashes = EngineHasher(EngineHashSpec("vllm", "sha256_cbor"), P).block_hashes(tokens)
    stored = BlockStored(hashes[2:4], hashes[1], tokens[2 * P : 4 * P], P, None, "GPU", None)
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, [stored], 0))
    with TestClient(build_service(config, index=index, ingest=sub)) as client:
        for name in ("a", "b"):
            sub.ingest(name, 0, payload)
        body = client.post("/v1/lookup", json={"model": "llama", "tokens": tokens}).json()
    got = {s["name"]: s["cached_tokens"] for s in body["replicas"]}
    assert got == {"a": 4 * P, "b": 0}  # b: no engine hashes, no route of this prompt
    assert sub.counters()["a"].placed_late == 4


def test_a_run_is_placed_when_its_parent_is_stored_after_it_and_removals_reach_it() -> None:
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod", None, None, NS, P)])
    router = Router(index, [ReplicaSpec("pod", NS, P)], held=sub.unplaced)
    tokens = list(range(50, 50 + 3 * P))
    other = list(range(900, 900 + 2 * P))

    def send(seq: int, *events: Any) -> None:
        sub.ingest("pod", seq, msgspec.msgpack.encode(KVEventBatch(float(seq), list(events), 0)))

    send(0, BlockStored([12, 13], 11, tokens[P:], P, None, "GPU", None))
    send(1, BlockRemoved([999], "GPU"))  # a hash never seen: harmless
    send(2, BlockStored([22], 21, other[P:], P, None, "GPU", None))
    send(3, BlockRemoved([22], "GPU"))  # an unplaced block leaves: nothing of it stays
    assert (_cached(router, tokens), _cached(router, other)) == (0, 0)
    send(
        4,
        BlockStored([11], None, tokens[:P], P, None, "GPU", None),
        BlockStored([21], None, other[:P], P, None, "GPU", None),
    )
    assert (_cached(router, tokens), _cached(router, other)) == (3, 1)
    send(5, BlockRemoved([13], "GPU"))
    assert _cached(router, tokens) == 2
    c = sub.counters()["pod"]
    assert (c.unplaced, c.placed_late, c.malformed) == (3, 2, 0)


def test_blocks_placed_by_a_lookup_reach_a_shared_index_and_its_engine_map(redis_server) -> None:
    """On Redis, what a lookup places is written with its engine hashes: a router joining
    later maps the replica's removal of those blocks (no stale entry)."""
    import os

    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    prefix = f"unplaced{os.urandom(4).hex()}"
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    ep = ReplicaEndpoint("pod", None, None, NS, P, engine_hash=SHA_CBOR)
    sub = KVEventSubscriber(index, [ep])
    router = Router(index, [ReplicaSpec("pod", NS, P)], held=sub.unplaced)
    tokens = list(range(30, 30 + 4 * P))
    hashes = EngineHasher(SHA_CBOR, P).block_hashes(tokens)
    stored = BlockStored(hashes[2:], hashes[1], tokens[2 * P :], P, None, "GPU", None)
    sub.ingest("pod", 5, msgspec.msgpack.encode(KVEventBatch(5.0, [stored], 0)))
    assert _cached(router, tokens) == 4
    index.flush()
    later = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    late_sub = KVEventSubscriber(later, [ReplicaEndpoint("pod", None, None, NS, P)])
    removed = BlockRemoved([hashes[3]], "GPU")
    late_sub.ingest("pod", 6, msgspec.msgpack.encode(KVEventBatch(6.0, [removed], 0)))
    later.flush()
    late_router = Router(later, [ReplicaSpec("pod", NS, P)])
    assert _cached(late_router, tokens) == 3
    assert late_sub.counters()["pod"].recalled == 4  # the four placed blocks, on joining
    for x in (index, later):
        x.client.close()


def test_ancestors_stay_held_after_the_blocks_that_vouched_for_them_are_evicted() -> None:
    """The engine frees a request's blocks tail first: once the kept block that vouched for a
    prefix and the prefix's own last block are evicted, the rest of the prefix is still held
    (and counted), until a removal of its own is seen."""
    from prefixcache.fleet.events.unplaced import UnplacedBlocks, engine_match

    prefix = [101, 102, 103]  # engine hashes the router never saw stored
    kept = UnplacedBlocks()
    # a request for the prefix plus one more block: the engine stores the new block under it
    kept.keep([900], 103, b"\0" * 64, 64, 1, 1, None)
    assert engine_match({}, kept, prefix).blocks == 3
    kept.removed(900, 1, 2)  # the tail goes first
    kept.removed(103, 1, 3)
    assert engine_match({}, kept, prefix).blocks == 2
    assert engine_match({}, kept, prefix).gpu_blocks == 2
    kept.removed(102, 1, 4)
    assert engine_match({}, kept, prefix).blocks == 1
    kept.removed(101, 1, 5)
    assert engine_match({}, kept, prefix).blocks == 0
    # stored again later: held again
    kept.keep([101, 102], 555, b"\0" * 128, 64, 1, 6, None)
    assert engine_match({}, kept, [555, 101, 102]).blocks == 3


def test_a_lookup_finds_a_prefix_whose_voucher_and_tail_were_evicted() -> None:
    """Through the router: a prefix held but never seen stored, vouched for by one request's new
    block, then that block and the prefix's last block evicted (tail first) before any lookup:
    the rest of the prefix is still the engine's, and the lookup says so."""
    index = MemoryFleetIndex()
    ep = ReplicaEndpoint("pod", None, None, NS, P, engine_hash=SHA_CBOR)
    sub = KVEventSubscriber(index, [ep])
    router = Router(index, [ReplicaSpec("pod", NS, P)], held=sub.unplaced)
    prefix = list(range(300, 300 + 4 * P))
    fresh = [7] * P
    hashes = EngineHasher(SHA_CBOR, P).block_hashes(prefix + fresh)

    def send(seq: int, *events: Any) -> None:
        sub.ingest("pod", seq, msgspec.msgpack.encode(KVEventBatch(float(seq), list(events), 0)))

    send(0, BlockStored([hashes[4]], hashes[3], fresh, P, None, "GPU", None))
    send(1, BlockRemoved([hashes[4]], "GPU"), BlockRemoved([hashes[3]], "GPU"))
    assert _cached(router, prefix) == 3
    send(2, BlockRemoved([hashes[1]], "GPU"))
    assert _cached(router, prefix) == 1
