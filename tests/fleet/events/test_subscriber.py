"""The subscriber against real publishers and managers: after every fault the index equals what
each replica's manager really holds."""

from __future__ import annotations

import os
import random

import msgspec
import pytest
from fleet_support import manager_digests, wait_until

from prefixcache import CacheManager, Namespace
from prefixcache.errors import ConfigError, FleetCapacityError, InvalidArgumentError
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.publisher import KVEventPublisher
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex

NS = Namespace("llama", salt="t1")
P = 4


def _held(index: MemoryFleetIndex, name: str) -> set[bytes]:
    return set(index.holdings(name))


def _workload(mgr: CacheManager, rng: random.Random, steps: int, tag: str) -> None:
    """Admit, release and evict; a few shared prefixes so eviction happens."""
    for k in range(steps):
        rid = f"{tag}{k}"
        prefix = [rng.randrange(3)] * 8
        ns = NS if k % 3 else Namespace("llama", adapter="sql")
        try:
            mgr.admit(rid, prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))], ns)
        except Exception:
            mgr.evict(mgr.block_counts().cached)
            continue
        mgr.end_step()
        mgr.release(rid)


class Replica:
    def __init__(self, name: str, seed: int, replay: bool = True, buffer_steps: int = 10_000):
        self.name = name
        self.mgr = CacheManager(24, P)
        self.rng = random.Random(seed)
        self.pub = KVEventPublisher(
            "tcp://127.0.0.1:*",
            "tcp://127.0.0.1:*" if replay else None,
            buffer_steps=buffer_steps,
        )
        self.pub.attach(self.mgr)

    def endpoint(self) -> ReplicaEndpoint:
        return ReplicaEndpoint(
            self.name, self.pub.endpoint, self.pub.replay_endpoint, Namespace("llama"), P
        )

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            _workload(self.mgr, self.rng, 1, f"{self.name}-{self.rng.random()}-")
            self.pub.flush()


def _in_sync(index, sub, replicas) -> bool:
    counters = sub.counters()
    return all(
        counters[r.name].last_seq == r.pub.next_seq - 1
        and _held(index, r.name) == manager_digests(r.mgr)
        for r in replicas
    )


def _connect(index, sub, replicas) -> None:
    """Publish AllBlocksCleared probes until every SUB socket is connected."""
    for r in replicas:
        wait_until(
            lambda r=r: (
                r.mgr.reset(force=True),
                r.pub.flush(),
                sub.counters()[r.name].batches > 0,
            )[2],
            what=f"{r.name} connected",
        )


@pytest.fixture
def fleet():
    index = MemoryFleetIndex()
    replicas = [Replica(f"pod-{k}", k) for k in range(3)]
    sub = KVEventSubscriber(index, [r.endpoint() for r in replicas], replay_timeout=2.0)
    sub.start()
    _connect(index, sub, replicas)
    yield index, sub, replicas
    sub.stop()
    for r in replicas:
        r.pub.close()


def test_streams_from_many_replicas_match_their_managers(fleet):
    index, sub, replicas = fleet
    for _ in range(10):
        for r in replicas:
            r.step()
    wait_until(lambda: _in_sync(index, sub, replicas), what="index in sync")
    # a prompt the router would send: digests by prefixcache's own hasher
    r0 = replicas[0]
    mgr = r0.mgr
    mgr.admit("probe", [7] * 8 + [1, 2, 3, 4], NS)
    mgr.end_step()
    r0.pub.flush()
    wait_until(lambda: _in_sync(index, sub, replicas), what="probe indexed")
    digests = mgr.hasher.hash_prompt([7] * 8 + [1, 2, 3, 4], NS)
    assert {m.replica: m.blocks for m in index.match(digests)}["pod-0"] == 3
    assert sub.counters()["pod-0"].malformed == 0


def test_dropped_messages_are_replayed(fleet):
    index, sub, replicas = fleet
    r = replicas[1]
    real_send = r.pub._pub.send_multipart
    r.pub._pub.send_multipart = lambda frames: None  # the network drops them
    r.step(4)
    r.pub._pub.send_multipart = real_send
    r.step()
    wait_until(lambda: _in_sync(index, sub, replicas), what="gap filled")
    c = sub.counters()["pod-1"]
    assert c.gaps == 1 and c.replays == 1 and c.resets == 0


def test_gap_without_replay_clears_the_replica():
    index = MemoryFleetIndex()
    r = Replica("solo", 5, replay=False)
    sub = KVEventSubscriber(index, [ReplicaEndpoint("solo", None, None, Namespace("llama"), P)])
    payloads = []
    r.pub.publish_payload = lambda payload: payloads.append(payload) or len(payloads) - 1
    r.step(3)
    for seq in (0, 2):  # 1 is lost
        sub.ingest("solo", seq, payloads[seq])
    c = sub.counters()["solo"]
    assert c.gaps == 1 and c.replays == 0 and c.cleared >= 1
    # what is indexed is a subset of the truth (stale entries were dropped, not kept)
    assert _held(index, "solo") <= manager_digests(r.mgr)
    r.pub.close()


def _rebind(endpoint: str, replay: str | None) -> KVEventPublisher:
    """Bind the old addresses again (the old sockets release them asynchronously)."""
    out: list[KVEventPublisher] = []

    def bound() -> bool:
        try:
            out.append(KVEventPublisher(endpoint, replay))
        except ConfigError:
            return False
        return True

    wait_until(bound, what="old address free")
    return out[0]


def test_publisher_restart_resets_that_replica_only(fleet):
    index, sub, replicas = fleet
    for r in replicas:
        r.step(3)
    wait_until(lambda: _in_sync(index, sub, replicas), what="in sync")
    old = replicas[2]
    other_before = _held(index, "pod-0")
    endpoint, replay = old.pub.endpoint, old.pub.replay_endpoint
    old_last = sub.counters()["pod-2"].last_seq
    assert old_last >= 3
    old.pub.close()
    # the engine restarts on the same address, with an empty cache and sequence 0
    new = Replica.__new__(Replica)
    new.name, new.rng, new.mgr = old.name, random.Random(9), CacheManager(24, P)
    new.pub = _rebind(endpoint, replay)
    new.pub.attach(new.mgr)
    replicas[2] = new
    # The SUB socket reconnects on its own; each batch waits until the subscriber saw it or a
    # short deadline passed, so the new stream is seen before it passes the old sequence.
    for _ in range(old_last):
        new.step()
        try:
            wait_until(lambda: sub.counters()["pod-2"].resets >= 1, timeout=0.3)
            break
        except AssertionError:
            continue
    assert sub.counters()["pod-2"].resets == 1
    wait_until(lambda: _in_sync(index, sub, replicas), what="in sync after restart")
    assert _held(index, "pod-0") == other_before
    new.pub.close()


def test_malformed_payloads_are_counted_not_fatal(fleet):
    index, sub, replicas = fleet
    r = replicas[0]
    seq = r.pub.publish_payload(b"\x93garbage")
    r.pub.publish_payload(msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]))
    bad_size = kv_wire.KVEventBatch(
        1.0, [kv_wire.WireBlockStored([1], None, [1, 2, 3], 3, None, "GPU", None)]
    )
    r.pub.publish_payload(kv_wire.encode_batch(bad_size))
    r.pub._pub.send_multipart((b"", b"\x00"))  # two frames
    r.step(2)
    wait_until(lambda: _in_sync(index, sub, replicas), what="in sync after junk")
    assert sub.counters()["pod-0"].malformed >= 4
    assert seq >= 0


def test_removed_replica_leaves_the_index(fleet):
    index, sub, replicas = fleet
    for r in replicas:
        r.step(2)
    wait_until(lambda: _in_sync(index, sub, replicas), what="in sync")
    sub.remove_replica("pod-1")
    assert "pod-1" not in index.replicas() and "pod-1" not in sub.counters()
    with pytest.raises(InvalidArgumentError):
        sub.remove_replica("pod-1")
    with pytest.raises(InvalidArgumentError):
        sub.ingest("pod-1", 0, b"")


def test_abuse_is_bounded_with_clear_errors():
    index = MemoryFleetIndex(max_replicas=50)
    sub = KVEventSubscriber(index, max_replicas=10_000, max_tokens_per_event=4096)
    for k in range(10_000):
        sub.add_replica(ReplicaEndpoint(f"r{k}", block_size=P))
    with pytest.raises(FleetCapacityError):
        sub.add_replica(ReplicaEndpoint("one-too-many", block_size=P))
    with pytest.raises(InvalidArgumentError):
        sub.add_replica(ReplicaEndpoint("r1", block_size=P))
    with pytest.raises(InvalidArgumentError):
        sub.add_replica(ReplicaEndpoint("x" * 1000, block_size=P))
    huge = kv_wire.KVEventBatch(
        1.0, [kv_wire.WireBlockStored(list(range(2048)), None, [1] * 8192, P, None, "GPU", None)]
    )
    assert sub.ingest("r0", 0, kv_wire.encode_batch(huge)) == 1
    assert sub.counters()["r0"].malformed == 1 and index.replicas() == []
    one = kv_wire.KVEventBatch(
        1.0, [kv_wire.WireBlockStored([1], None, [1] * P, P, None, "GPU", None)]
    )
    for k in range(50):
        sub.ingest(f"r{k}", 0, kv_wire.encode_batch(one))
    assert len(index.replicas()) == 50
    # the 51st replica does not fit the index: counted, the subscriber goes on
    with pytest.raises(FleetCapacityError):
        sub.ingest("r50", 0, kv_wire.encode_batch(one))
    assert index.num_blocks("r0") == 1


def test_redis_index_from_live_streams_survives_a_redis_restart(redis_server):
    """Managers -> publishers -> subscriber -> Redis; Redis is killed mid-stream and restarted
    empty: once resynced, another router reading Redis alone sees exactly what each manager
    holds."""
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    index = RedisFleetIndex.from_url(redis_server.url, retry_interval=0.0, pipeline_size=8)
    replicas = [Replica(f"pod-{k}", 10 + k) for k in range(2)]
    sub = KVEventSubscriber(index, [r.endpoint() for r in replicas], replay_timeout=2.0)
    sub.start()
    try:
        _connect(index, sub, replicas)

        def in_sync() -> bool:
            counters = sub.counters()
            return all(
                counters[r.name].last_seq == r.pub.next_seq - 1
                and set(index.holdings(r.name)) == manager_digests(r.mgr)
                for r in replicas
            )

        for _ in range(6):
            for r in replicas:
                r.step()
        wait_until(in_sync, what="index in sync before the outage")
        redis_server.kill()
        for _ in range(6):  # the stream goes on while Redis is away
            for r in replicas:
                r.step()
        wait_until(in_sync, what="local view in sync during the outage")
        assert index.stats().errors >= 1
        redis_server.start()  # empty: no persistence
        wait_until(index.flush, what="resync")
        fresh = RedisFleetIndex.from_url(redis_server.url)
        for r in replicas:
            assert set(fresh.holdings(r.name)) == manager_digests(r.mgr)
        fresh.client.close()
    finally:
        sub.stop()
        for r in replicas:
            r.pub.close()
        index.client.close()


# ---- vLLM's events, as its engine emits them ----------------------------------------------------

VLLM_TOKENS = list(range(1, 9))  # two blocks of 4


def _vllm_batch(*events: object, ts: float = 1.0) -> bytes:
    return kv_wire.encode_batch(kv_wire.KVEventBatch(ts, list(events)))


def _vllm_ingest(*batches: list[object]) -> tuple[MemoryFleetIndex, KVEventSubscriber]:
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(
        index, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    for seq, events in enumerate(batches):
        sub.ingest("pod", seq, _vllm_batch(*events))
    return index, sub


def _cached_blocks(index: MemoryFleetIndex, ns: Namespace) -> int:
    from prefixcache.blocks.hashing import BlockHasher

    digests = BlockHasher(P).hash_prompt(VLLM_TOKENS, ns)
    return {m.replica: m.blocks for m in index.match(digests)}.get("pod", 0)


def test_a_sliding_window_groups_removal_leaves_the_main_groups_blocks() -> None:
    """A hybrid model's window group evicts blocks whose hashes equal the main group's: only
    removals of the main group (group_idx 0 or absent) take blocks out of the index."""
    stored = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, None, "GPU", None, group_idx=0)
    index, sub = _vllm_ingest([stored], [kv_wire.WireBlockRemoved([11, 12], "GPU", group_idx=1)])
    assert _cached_blocks(index, Namespace("llama")) == 2
    sub.ingest("pod", 2, _vllm_batch(kv_wire.WireBlockRemoved([12], "GPU", group_idx=0)))
    assert _cached_blocks(index, Namespace("llama")) == 1
    assert sub.counters()["pod"].malformed == 0


def test_lora_and_cache_salt_keys_give_the_namespace_the_router_hashes() -> None:
    """vLLM hashes the LoRA name as every block's first extra key, and cache_salt as the first
    block's last one: the blocks must land under (model, adapter, salt) as a routed request's
    prompt is hashed, not under opaque extra keys."""
    lora = kv_wire.WireBlockStored(
        [1, 2],
        None,
        VLLM_TOKENS,
        P,
        7,
        "GPU",
        "sql-lora",
        extra_keys=[("sql-lora",), ("sql-lora",)],
    )
    salted = kv_wire.WireBlockStored(
        [3, 4], None, VLLM_TOKENS, P, 7, "GPU", "sql-lora",
        extra_keys=[("sql-lora", "tenant-a"), ("sql-lora",)],
    )  # fmt: skip
    plain_salt = kv_wire.WireBlockStored(
        [5, 6], None, VLLM_TOKENS, P, None, "GPU", None, extra_keys=[("tenant-b",), None]
    )
    index, sub = _vllm_ingest([lora, salted, plain_salt])
    assert _cached_blocks(index, Namespace("llama", adapter="sql-lora")) == 2
    assert _cached_blocks(index, Namespace("llama", adapter="sql-lora", salt="tenant-a")) == 2
    assert _cached_blocks(index, Namespace("llama", salt="tenant-b")) == 2
    assert _cached_blocks(index, Namespace("llama")) == 0
    assert sub.counters()["pod"].malformed == 0


def test_another_adapters_blocks_carry_the_version_the_fleet_pins_for_it() -> None:
    """A replica dedicated to adapter A@v1 that also serves B (or any adapter): its B blocks
    are not B@v1; and a "*" replica's A blocks are A@v1, as the router's clients name A."""
    from prefixcache.fleet.replica_spec import ReplicaSpec
    from prefixcache.fleet.router import Router

    ded, any_ = Namespace("m", "A", "v1"), Namespace("m")
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(
        index,
        [
            ReplicaEndpoint("ded", namespace=ded, block_size=P),
            ReplicaEndpoint("any", namespace=any_, block_size=P),
        ],
    )
    router = Router(
        index,
        [ReplicaSpec("ded", ded, P, adapters=("B",)), ReplicaSpec("any", any_, P, adapters=("*",))],
    )

    def lora(name: str, hashes: list[int]) -> kv_wire.WireBlockStored:
        return kv_wire.WireBlockStored(
            hashes, None, VLLM_TOKENS, P, 7, "GPU", name, extra_keys=[(name,), (name,)]
        )

    sub.ingest("ded", 0, _vllm_batch(lora("B", [1, 2])))
    sub.ingest("any", 0, _vllm_batch(lora("A", [3, 4])))
    cached = {
        ns.adapter: {s.name: s.cached_tokens for s in router.lookup(ns, VLLM_TOKENS).scores}
        for ns in (Namespace("m", "B"), Namespace("m", "A", "v1"))
    }
    assert cached == {"B": {"ded": 8, "any": 0}, "A": {"ded": 0, "any": 8}}


def test_a_cpu_store_without_tokens_keeps_offloaded_blocks_in_the_index() -> None:
    """vLLM's CPU offload announces blocks it copied from the GPU with their hashes only: they
    are on CPU too, and stay indexed when the GPU copy goes."""
    stored = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, None, "GPU", None)
    offloaded = kv_wire.WireBlockStored([11, 12], None, [], P, None, "CPU", None)
    index, sub = _vllm_ingest([stored], [offloaded], [kv_wire.WireBlockRemoved([11, 12], "GPU")])
    assert _cached_blocks(index, Namespace("llama")) == 2
    match = index.match(_digests(VLLM_TOKENS))[0]
    assert (match.blocks, match.gpu_blocks) == (2, 0)  # on CPU only now
    assert sub.counters()["pod"].malformed == 0
    unknown = kv_wire.WireBlockStored([99], None, [], P, None, "CPU", None)
    sub.ingest("pod", 3, _vllm_batch(unknown))
    assert sub.counters()["pod"].malformed == 1 and _cached_blocks(index, Namespace("llama")) == 2


def _digests(tokens: list[int]) -> list[bytes]:
    from prefixcache.blocks.hashing import BlockHasher

    return BlockHasher(P).hash_prompt(tokens, Namespace("llama"))


def test_an_endpoint_zmq_cannot_connect_to_leaves_the_other_replicas_ingesting() -> None:
    index = MemoryFleetIndex()
    good = Replica("good", 1, replay=False)
    bind_only = ReplicaEndpoint("bad", "tcp://*:5557", None, Namespace("llama"), P)
    sub = KVEventSubscriber(index, [good.endpoint(), bind_only])
    sub.start()
    try:
        _connect(index, sub, [good])
        good.step(3)
        wait_until(lambda: _in_sync(index, sub, [good]), what="the good replica in sync")
        assert sub.counters()["bad"].malformed == 1
    finally:
        sub.stop()
        good.pub.close()


def test_lora_blocks_known_only_by_id_are_skipped_not_taken_for_the_base_model() -> None:
    """Older vLLM layouts and SGLang announce LoRA blocks by ``lora_id`` alone: without the
    adapter's name they must not be indexed under the base model (false hits)."""
    by_id = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, 7, "GPU", None)
    index, sub = _vllm_ingest([by_id])
    assert _cached_blocks(index, Namespace("llama")) == 0
    c = sub.counters()["pod"]
    assert c.skipped == 2 and c.malformed == 0
    assert sub.ingest_counts()["pod"].blocks_skipped == 2


def test_a_hybrid_models_other_groups_are_skipped_not_errors() -> None:
    # every step of a hybrid model stores the same hashes for its window group too
    main = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, None, "GPU", None, group_idx=0)
    window = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, None, "GPU", None, group_idx=1)
    index, sub = _vllm_ingest([main, window], [window])
    assert _cached_blocks(index, Namespace("llama")) == 2
    c = sub.counters()["pod"]
    assert c.malformed == 0 and c.skipped == 4


def test_an_undecodable_message_is_counted_and_is_no_gap() -> None:
    """One bad payload must not clear the replica: its number still counts."""
    first = kv_wire.WireBlockStored([11], None, VLLM_TOKENS[:4], P, None, "GPU", None)
    index, sub = _vllm_ingest([first])
    assert sub.ingest("pod", 1, b"\x93garbage") == 0
    second = kv_wire.WireBlockStored([12], 11, VLLM_TOKENS[4:], P, None, "GPU", None)
    sub.ingest("pod", 2, _vllm_batch(second))
    c = sub.counters()["pod"]
    assert (c.malformed, c.gaps, c.cleared, c.last_seq) == (1, 0, 0, 2)
    assert _cached_blocks(index, Namespace("llama")) == 2


def test_a_router_joining_a_stream_keeps_what_a_shared_index_holds() -> None:
    """A second router (or a restarted one) on a shared index sees a replica's stream from the
    middle: without a replay it must not wipe what the index holds for everyone; a gap after it
    has seen the stream still clears."""
    index = MemoryFleetIndex()  # stands in for the shared Redis index
    stored = kv_wire.WireBlockStored([11, 12], None, VLLM_TOKENS, P, None, "GPU", None)
    first = KVEventSubscriber(
        index, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    first.ingest("pod", 0, _vllm_batch(stored))
    joined = KVEventSubscriber(
        index, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    joined.ingest("pod", 5, _vllm_batch(kv_wire.WireBlockRemoved([99], "GPU")))
    assert _cached_blocks(index, Namespace("llama")) == 2
    c = joined.counters()["pod"]
    assert (c.gaps, c.cleared, c.last_seq) == (1, 0, 5)
    joined.ingest("pod", 9, _vllm_batch(kv_wire.WireBlockRemoved([99], "GPU")))  # a real loss
    assert joined.counters()["pod"].cleared == 1
    assert _cached_blocks(index, Namespace("llama")) == 0


def test_counters_do_not_wait_for_an_ingestion_in_progress() -> None:
    """A metrics scrape reads the counters while the ingestion holds its lock (e.g. waiting on
    a replay endpoint)."""
    import threading

    _, sub = _vllm_ingest([])
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with sub._lock:
            held.set()
            done.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    try:
        result: list[object] = []
        reader = threading.Thread(target=lambda: result.append(sub.ingest_counts()))
        reader.start()
        reader.join(2)
        assert result and "pod" in result[0]  # type: ignore[operator]
        assert sub.counters()["pod"].batches == 1
    finally:
        done.set()
        thread.join()


# ---- a router joining a stream on a shared (Redis) index -----------------------------------------


def _redis_router(url: str, prefix: str, replay: str | None = None):
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    index = RedisFleetIndex.from_url(url, prefix=prefix)
    endpoint = ReplicaEndpoint("pod", None, replay, Namespace("llama"), P)
    return index, KVEventSubscriber(index, [endpoint])


def _stored(hashes: list[int], parent: int | None, first_token: int) -> kv_wire.WireBlockStored:
    tokens = list(range(first_token, first_token + P * len(hashes)))
    return kv_wire.WireBlockStored(hashes, parent, tokens, P, None, "GPU", None)


def _one_block_batches(url: str, prefix: str, batches: int):
    """A router on Redis that applied ``batches`` batches of one new block each (block ``k``:
    engine hash 10 + k, tokens from 100 k, stamped k)."""
    index, sub = _redis_router(url, prefix)
    for seq in range(batches):
        sub.ingest("pod", seq, _vllm_batch(_stored([10 + seq], None, 100 * seq), ts=seq))
    assert index.flush()
    return index, sub


def _rejoin_after(url: str, batches: int):
    """The router above, restarted: a new one on the same Redis (it has heard nothing yet)."""
    index, _ = _one_block_batches(url, f"r{os.urandom(4).hex()}", batches)
    index.client.close()
    return _redis_router(url, index.prefix)


def test_a_restarted_router_maps_blocks_stored_before_it_through_redis(redis_server):
    """A lone router on a Redis index restarts: removals and continuations of blocks stored
    before the restart used to be unknown engine hashes (stale entries, 'unknown parent')."""
    prefix = f"j{os.urandom(4).hex()}"
    batches = [
        _vllm_batch(_stored([11, 12], None, 1)),
        _vllm_batch(_stored([21], None, 100)),
        _vllm_batch(kv_wire.WireBlockRemoved([21], "GPU"), _stored([13], 12, 9)),
    ]
    index, sub = _redis_router(redis_server.url, prefix)
    sub.ingest("pod", 0, batches[0])
    sub.ingest("pod", 1, batches[1])
    assert index.flush()
    index.client.close()
    index, sub = _redis_router(redis_server.url, prefix)  # the restart: it hears batch 2 next
    truth = MemoryFleetIndex()
    every = KVEventSubscriber(
        truth, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    for seq, payload in enumerate(batches):
        every.ingest("pod", seq, payload)
    sub.ingest("pod", 2, batches[2])
    assert index.flush()
    assert set(index.holdings("pod")) == set(truth.holdings("pod"))
    counters = sub.counters()["pod"]
    assert counters.malformed == 0 and counters.recalled == 3  # all it held, on joining
    index.client.close()


def _first_digest(first_token: int) -> bytes:
    from prefixcache.blocks.hashing import BlockHasher

    tokens = list(range(first_token, first_token + P))
    return BlockHasher(P).hash_prompt(tokens, Namespace("llama"))[0]


def test_a_restarted_router_on_redis_replays_only_what_it_missed(redis_server):
    """Live streams: the router stops, the replicas go on, a new router starts on the same
    Redis. It replays the batches after the last one the index applied (the replica's replay
    buffer no longer has batch 0) and maps the blocks stored before: the index ends up exactly
    what each manager holds."""
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    prefix = f"rr{os.urandom(4).hex()}"
    replicas = [Replica(f"pod-{k}", 40 + k, buffer_steps=30) for k in range(2)]
    try:
        index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
        sub = KVEventSubscriber(index, [r.endpoint() for r in replicas])
        sub.start()
        try:
            _connect(index, sub, replicas)
            for _ in range(40):
                for r in replicas:
                    r.step()
            wait_until(lambda: _in_sync(index, sub, replicas), what="in sync before the stop")
        finally:
            sub.stop()
            index.client.close()
        for _ in range(3):  # nobody listens
            for r in replicas:
                r.step()
        index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
        sub = KVEventSubscriber(index, [r.endpoint() for r in replicas], replay_timeout=2.0)
        sub.start()
        try:
            for r in replicas:  # no reset this time: step until the new socket hears
                wait_until(
                    lambda r=r: (r.step(), sub.counters()[r.name].batches > 0)[1],
                    what=f"{r.name} heard again",
                )
            for _ in range(12):
                for r in replicas:
                    r.step()
            wait_until(lambda: _in_sync(index, sub, replicas), what="in sync after the restart")
            counters = sub.counters()
            assert all(counters[r.name].replays == 1 for r in replicas)
            assert all(counters[r.name].malformed == 0 for r in replicas)
        finally:
            sub.stop()
            index.client.close()
    finally:
        for r in replicas:
            r.pub.close()


def test_a_router_joining_a_restarted_replica_on_redis_clears_its_old_blocks(redis_server):
    # the engine restarted while no router listened: batch 3 of its new stream is a number the
    # index already applied, on a newer batch; the old blocks stayed (batch 0 alone was caught)
    index, sub = _rejoin_after(redis_server.url, batches=6)
    sub.ingest("pod", 3, _vllm_batch(_stored([99], None, 900), ts=100.0))
    assert set(index.holdings("pod")) == {_first_digest(900)}
    counters = sub.counters()["pod"]
    assert counters.resets == 1 and counters.gaps == 1  # batches 0-2 of the new stream: lost
    index.client.close()


def test_a_router_joining_behind_the_others_on_redis_keeps_their_blocks(redis_server):
    # another router already applied (and wrote) the batch this one hears first
    index, _ = _one_block_batches(redis_server.url, f"b{os.urandom(4).hex()}", 4)
    late, late_sub = _redis_router(redis_server.url, index.prefix)
    late_sub.ingest("pod", 3, _vllm_batch(_stored([13], None, 300), ts=3))
    late_sub.ingest("pod", 4, _vllm_batch(kv_wire.WireBlockRemoved([11], "GPU"), ts=4))
    expected = {_first_digest(100 * k) for k in (0, 2, 3)}
    assert set(late.holdings("pod")) == expected
    counters = late_sub.counters()["pod"]
    assert counters.resets == 0 and counters.recalled == 4  # every block it held, on joining
    for x in (index, late):
        x.client.close()


def test_a_router_joining_after_batches_no_router_applied_clears_the_replica(redis_server):
    # the index says batch 3 was applied last; batches 4-5 (an eviction, say) reached no
    # router and cannot be replayed: what the index holds for the replica may be stale
    index, sub = _rejoin_after(redis_server.url, batches=4)
    sub.ingest("pod", 6, _vllm_batch(_stored([16], None, 600), ts=6))
    assert set(index.holdings("pod")) == {_first_digest(600)}
    assert sub.counters()["pod"].cleared == 1
    index.client.close()


def test_a_new_stream_past_the_applied_number_is_told_by_its_replay(redis_server):
    # the engine restarted while no router listened and published past batch 3: only the
    # replay of batch 3 (stamped otherwise) tells it from the old stream
    first, _ = _one_block_batches(redis_server.url, f"p{os.urandom(4).hex()}", 4)
    prefix = first.prefix
    first.client.close()
    new = {k: _vllm_batch(_stored([50 + k], None, 5000 + 100 * k), ts=100 + k) for k in range(7)}
    index, sub = _redis_router(redis_server.url, prefix, replay="tcp://127.0.0.1:1")

    def replay(rep, start, end):
        return [(k, new[k]) for k in range(start, end)]

    sub._replay = replay  # type: ignore[method-assign]  # the new engine's replay buffer
    sub.ingest("pod", 6, new[6])
    assert set(index.holdings("pod")) == {_first_digest(5000 + 100 * k) for k in range(7)}
    assert sub.counters()["pod"].resets == 1
    index.client.close()


def test_a_router_joining_while_redis_is_away_waits_to_map_the_old_blocks(redis_server):
    # the lookup of blocks stored before it came failed: first the events were dropped (stale
    # entries), then the replica was cleared, wiping what other routers had right in Redis
    import redis

    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    prefix = f"w{os.urandom(4).hex()}"
    batches = [
        _vllm_batch(_stored([11, 12], None, 1)),
        _vllm_batch(_stored([21], None, 100)),
        _vllm_batch(_stored([13], 12, 9)),
        _vllm_batch(kv_wire.WireBlockRemoved([21], "GPU")),
        _vllm_batch(_stored([41], None, 400)),
    ]
    other, other_sub = _redis_router(redis_server.url, prefix)  # follows the whole stream
    for seq in range(2):
        other_sub.ingest("pod", seq, batches[seq])
    assert other.flush()
    index, sub = _redis_router(redis_server.url, prefix)
    index.retry_interval = 3600.0
    index.sync.failed(redis.ConnectionError("away"))
    sub.ingest("pod", 2, batches[2])  # a continuation of a block stored before it came
    sub.ingest("pod", 3, batches[3])  # a removal of one
    assert sub.counters()["pod"].blocks_stored == 0  # both wait, in order
    index.retry_interval = 0.0  # Redis is back: the sender thread finds it
    wait_until(lambda: index.stats().in_sync, what="the resync")
    sub.ingest("pod", 4, batches[4])
    assert index.flush()
    truth = MemoryFleetIndex()
    every = KVEventSubscriber(
        truth, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    for seq, payload in enumerate(batches):
        every.ingest("pod", seq, payload)
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert set(fresh.holdings("pod")) == set(truth.holdings("pod"))
    counters = sub.counters()["pod"]
    assert counters.recalled == 2 and counters.cleared == 0 and counters.malformed == 0
    for x in (fresh, index, other):
        x.client.close()


def test_engine_map_keys_stay_short() -> None:
    from prefixcache.fleet.events.replica_stream import engine_key

    assert engine_key(-5) == b"i-5" and engine_key(b"ab") == b"bab"
    long = engine_key(b"x" * 1000)  # an engine hash of any length maps to a short key
    assert long[:1] == b"h" and len(long) == 17 and long != engine_key(b"x" * 999)


def test_removals_of_blocks_skipped_by_rule_need_no_lookup(redis_server):
    # a router that joined midway looked up every unknown removal in Redis, one round trip per
    # event, including those of nameless-LoRA blocks it skipped itself
    prefix = f"k{os.urandom(4).hex()}"
    index, sub = _redis_router(redis_server.url, prefix)
    sub.ingest("pod", 0, _vllm_batch(_stored([11], None, 1)))
    assert index.flush()
    index.client.close()
    index, sub = _redis_router(redis_server.url, prefix)
    lookups = []
    recall = index.recall
    index.recall = lambda replica, keys: lookups.append(keys) or recall(replica, keys)  # type: ignore[method-assign]
    nameless = kv_wire.WireBlockStored([31, 32], None, list(range(8)), P, 7, "GPU", None)
    sub.ingest("pod", 1, _vllm_batch(nameless))
    sub.ingest("pod", 2, _vllm_batch(kv_wire.WireBlockRemoved([31, 32], "GPU")))
    sub.ingest("pod", 3, _vllm_batch(kv_wire.WireBlockRemoved([11], "GPU")))
    assert lookups == []  # 11 was read on joining; the skipped ones need no lookup
    assert index.holdings("pod") == {}
    index.client.close()


def test_catch_up_brings_in_what_the_sub_socket_never_saw(fleet):
    """A replica publishes while the subscriber's SUB socket is not connected (a restarted
    replica answers before the reconnect comes round): PUB drops those batches, and with no later
    batch no gap shows. ``catch_up`` asks the replay endpoint for them."""
    index, sub, replicas = fleet
    r = replicas[0]
    wait_until(lambda: _in_sync(index, sub, replicas), what="in sync")
    before = sub.counters()["pod-0"]  # the fixture's connecting may have had a gap of its own
    real_send = r.pub._pub.send_multipart
    r.pub._pub.send_multipart = lambda frames: None  # nobody listening: PUB drops them
    try:
        r.step(6)
    finally:
        r.pub._pub.send_multipart = real_send
    missed = r.pub.next_seq - 1 - sub.counters()["pod-0"].last_seq  # a step may publish none
    assert missed > 0  # and the stream is quiet: nothing shows they are missing
    assert sub.catch_up("pod-0") == missed
    wait_until(lambda: _in_sync(index, sub, replicas), what="caught up")
    c = sub.counters()["pod-0"]
    assert (c.gaps, c.resets, c.late) == (before.gaps, before.resets, before.late)
    assert sub.catch_up("pod-0") == 0  # nothing after the last batch applied
    assert sub.catch_up("not-followed") == 0


def test_catch_up_without_a_replay_endpoint_queues_nothing():
    index = MemoryFleetIndex()
    r = Replica("solo", 5, replay=False)
    sub = KVEventSubscriber(index, [ReplicaEndpoint("solo", r.pub.endpoint, None, NS, P)])
    try:
        assert sub.catch_up("solo") == 0
    finally:
        r.pub.close()
