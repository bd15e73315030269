"""Crafted stores (a hash repeated in one event, a hash stored again under another parent, a
block given as its own parent) leave nothing in the index once the engine removed every hash,
on the memory index and on Redis."""

from __future__ import annotations

import os

import pytest

from prefixcache import Namespace
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.memory import MemoryFleetIndex

P = 4


def _stored(hashes: list[int], parent: int | None, first_token: int) -> kv_wire.WireBlockStored:
    tokens = list(range(first_token, first_token + P * len(hashes)))
    return kv_wire.WireBlockStored(hashes, parent, tokens, P, None, "GPU", None)


def _batch(*events: object) -> bytes:
    return kv_wire.encode_batch(kv_wire.KVEventBatch(1.0, list(events)))


CASES = {
    "hash repeated in one store": [[_stored([11, 11], None, 0)], [_stored([12, 13, 12], None, 50)]],
    "hash stored again under another parent": [
        [_stored([11], None, 0), _stored([12], None, 100)],
        [_stored([13], 11, 200)],
        [_stored([13], 12, 300)],
        [_stored([14], 13, 400), _stored([13], None, 500)],
    ],
    "block given as its own parent": [
        [_stored([11], None, 0)],
        [_stored([11], 11, 100)],
        [_stored([12, 13], 13, 200)],
    ],
}


def _index(kind: str, request: pytest.FixtureRequest):
    if kind == "memory":
        return MemoryFleetIndex()
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    server = request.getfixturevalue("redis_server")
    return RedisFleetIndex.from_url(server.url, prefix=f"c{os.urandom(4).hex()}")


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_stores_leave_nothing_after_every_removal(case, kind, request):
    index = _index(kind, request)
    sub = KVEventSubscriber(
        index, [ReplicaEndpoint("pod", namespace=Namespace("llama"), block_size=P)]
    )
    batches = CASES[case]
    for seq, events in enumerate(batches):
        sub.ingest("pod", seq, _batch(*events))
    hashes = sorted({h for events in batches for ev in events for h in ev.block_hashes})
    sub.ingest("pod", len(batches), _batch(kv_wire.WireBlockRemoved(hashes, "GPU")))
    if kind == "redis":
        assert index.flush()
    assert index.holdings("pod") == {}
    if kind == "redis":
        assert index.local.holdings("pod") == {}
        index.client.close()
