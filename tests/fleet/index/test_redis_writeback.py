"""Redis loses its data after a router restarted (or joined late): the write-back of the router's
view holds the blocks its subscriber recalled from Redis (stored before it came), not only those it
saw stored."""

from __future__ import annotations

import os

import pytest

from prefixcache import Namespace
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex

P = 4


def _stored(hashes: list[int], parent: int | None, first_token: int, medium: str = "GPU"):
    tokens = list(range(first_token, first_token + P * len(hashes)))
    return kv_wire.WireBlockStored(hashes, parent, tokens, P, None, medium, None)


def _batch(*events: object, ts: float) -> bytes:
    return kv_wire.encode_batch(kv_wire.KVEventBatch(ts, list(events)))


def _router(url: str, prefix: str):
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    index = RedisFleetIndex.from_url(url, prefix=prefix, retry_interval=0.0)
    ep = ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)
    return index, KVEventSubscriber(index, [ep])


@pytest.mark.parametrize("how", ["restart", "late join"])
def test_a_write_back_after_a_restart_or_a_late_join_holds_the_recalled_blocks(how, redis_server):
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    prefix = f"w{os.urandom(4).hex()}"
    before = [
        _batch(_stored([10], None, 0), ts=0),
        _batch(_stored([11], 10, 4), _stored([20], None, 100), ts=1),
        _batch(_stored([12], 11, 8), ts=2),
    ]
    after = [  # every block stored before the restart is touched: each is recalled
        _batch(
            _stored([13], 12, 12),
            kv_wire.WireBlockStored([11], None, [], 0, None, "CPU", None),
            kv_wire.WireBlockRemoved([20, 10], "GPU"),
            ts=3,
        ),
        _batch(_stored([14], 13, 16), ts=4),  # after the loss: the next write notices it
    ]
    first, sub = _router(redis_server.url, prefix)
    for seq, payload in enumerate(before):
        sub.ingest("pod", seq, payload)
    assert first.flush()
    if how == "restart":
        first.client.close()
    # the restarted router, or one joining beside the first (which writes nothing more here):
    # it hears batch 3 next
    index, sub = _router(redis_server.url, prefix)
    sub.ingest("pod", len(before), after[0])
    assert index.flush()
    assert sub.counters()["pod"].recalled == 4
    truth = MemoryFleetIndex()
    every = KVEventSubscriber(
        truth, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    for seq, payload in enumerate(before + after):
        every.ingest("pod", seq, payload)
    index.client.flushall()  # Redis restarted empty
    sub.ingest("pod", len(before) + 1, after[1])
    assert index.flush()  # the loss noticed, the view written back
    assert index.stats().resyncs == 1
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    try:
        held = fresh.holdings("pod")
        missing = set(truth.holdings("pod")) - set(held)
        print(f"{len(missing)} blocks missing after the write-back")
        assert held == truth.holdings("pod")
    finally:
        for x in (fresh, index, first):
            x.client.close()


def test_a_late_joiner_answers_from_a_whole_view_while_redis_hangs(redis_server):
    """A router joining a stream another router applied reads every block the replica holds
    from the shared engine map when it joins: with Redis then stopped (SIGSTOP), its local view
    answers every prefix the replica holds, not only those its first events named."""
    import signal

    from prefixcache.blocks.hashing import BlockHasher

    prefix = f"j{os.urandom(4).hex()}"
    before = [
        _batch(_stored([10, 11, 12], None, 0), ts=0),
        _batch(_stored([20, 21], None, 100), ts=1),
    ]
    first, sub = _router(redis_server.url, prefix)
    for seq, payload in enumerate(before):
        sub.ingest("pod", seq, payload)
    assert first.flush()
    index, late = _router(redis_server.url, prefix)
    index.sync.read_timeout = 0.3
    late.ingest("pod", len(before), _batch(_stored([13], 12, 12), ts=2))  # names 12 only
    assert index.flush()
    assert late.counters()["pod"].recalled == 5  # all it holds, on joining
    hasher = BlockHasher(P)
    prompts = {"first": list(range(0, 16)), "second": list(range(100, 108))}
    ns = Namespace("llama")
    digests = {name: hasher.hash_prompt(tokens, ns) for name, tokens in prompts.items()}
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        seen = {name: index.match(d) for name, d in digests.items()}
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert index.stats().errors >= 1  # answered from the local view
    assert {n: [(m.replica, m.blocks) for m in got] for n, got in seen.items()} == {
        "first": [("pod", 4)],
        "second": [("pod", 2)],
    }
    for x in (index, first):
        x.client.close()


def test_adoption_reads_the_engine_map_step_by_step_up_to_a_limit(redis_server, monkeypatch):
    """``adopt`` scans the replica's engine map a step at a time (each step a read of its own,
    so routes go on between them) and stops at a limit (the subscriber's per-replica cap): the
    local view then holds just the blocks adopted."""
    from prefixcache.fleet.index.redis import engine_map as redis_engine_map

    monkeypatch.setattr(redis_engine_map, "ADOPT_CHUNK", 2)
    prefix = f"a{os.urandom(4).hex()}"
    first, sub = _router(redis_server.url, prefix)
    sub.ingest("pod", 0, _batch(_stored([10, 11, 12, 13, 14], None, 0), ts=0))
    sub.ingest("pod", 1, _batch(kv_wire.WireBlockRemoved([14], "GPU"), ts=1))
    assert first.flush()
    later, _ = _router(redis_server.url, prefix)
    whole = later.adopt("pod")
    assert whole is not None and sorted(whole) == [b"i10", b"i11", b"i12", b"i13"]
    assert len(later.local.holdings("pod")) == 4
    capped, _ = _router(redis_server.url, prefix)
    some = capped.adopt("pod", limit=2)
    assert some is not None and len(some) == 2 and len(capped.local.holdings("pod")) == 2
    assert capped.adopt("nobody") == {}
    for x in (first, later, capped):
        x.client.close()
