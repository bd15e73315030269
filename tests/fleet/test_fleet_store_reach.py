"""Blocks in a shared K/V store are in reach of every replica attached to it: a runtime writes
its computed blocks through to the store and announces them (medium ``STORE``); the fleet
counts them for each replica configured with that ``kv_store``, below what a replica holds
itself, and forgets them when the store evicts them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")
pytest.importorskip("msgspec", reason="the fleet needs the service extra")

from prefixcache import CacheManager, Namespace, PagedKVCache
from prefixcache.fleet.events.publisher import to_wire
from prefixcache.fleet.events.replica_stream import ReplicaEndpoint
from prefixcache.fleet.events.subscriber import KVEventSubscriber
from prefixcache.fleet.events.wire import KVEventBatch, encode_batch
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.router import Router
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.lmdb import LMDBBlockStore

NS = Namespace(model="m")
P = 16


class Runtime:
    """One replica's runtime: a manager, its K/V, a store connector, and its events sent to
    the fleet's subscriber once a step, as a publisher would."""

    def __init__(self, name, store, subscriber, num_blocks=64):
        self.name, self.subscriber, self.seq = name, subscriber, 0
        self.kv = PagedKVCache(2, num_blocks, P, 8, 64, dtype=torch.float32)  # 128 KiB a block
        self.store = KVStoreConnector(store, self.kv, owns_backend=False)
        self.mgr = CacheManager(num_blocks, P, stepped=True, store=self.store)
        self.pending = []
        self.mgr.add_listener(lambda e: self.pending.append(to_wire(e)))
        self.store.add_listener(lambda e: self.pending.append(to_wire(e)))

    def serve(self, rid, tokens):
        adm = self.mgr.admit(rid, tokens, NS)
        t = self.mgr.take_transfers()
        assert self.store.load(t.store_loads) == []
        self.mgr.end_step()
        self.store.write_through(self.mgr.take_store_writes())
        self.store.flush()
        self.mgr.release(rid)
        self.publish()
        return adm.cached_len

    def publish(self):
        self.store.write_through([])  # delivers what the writer finished
        if self.pending:
            self.seq += 1
            payload = encode_batch(KVEventBatch(float(self.seq), self.pending, 0))
            self.subscriber.ingest(self.name, self.seq, payload)
            self.pending = []

    def close(self):
        self.store.close()


@pytest.fixture
def fleet(tmp_path):
    index = MemoryFleetIndex()
    specs = [
        ReplicaSpec("a", NS, P, 64, kv_store="pool"),
        ReplicaSpec("b", NS, P, 64, kv_store="pool"),
        ReplicaSpec("c", NS, P, 64),
    ]
    endpoints = [ReplicaEndpoint(s.name, None, None, NS, P, kv_store=s.kv_store) for s in specs]
    subscriber = KVEventSubscriber(index, endpoints)
    router = Router(index, specs, "prefix")
    store = LMDBBlockStore(tmp_path / "kv", capacity_bytes=1 << 20)
    yield router, subscriber, store
    store.close()


def cached(router, tokens):
    return {s.name: s.cached_tokens for s in router.lookup(NS, tokens).scores}


def gpu(router, tokens):
    return {s.name: s.gpu_cached_tokens for s in router.lookup(NS, tokens).scores}


def test_a_prefix_written_to_the_store_is_in_reach_of_attached_replicas(fleet):
    router, subscriber, store = fleet
    a = Runtime("a", store, subscriber)
    prompt = np.arange(100, 100 + 5 * P + 3, dtype=np.int32)
    assert a.serve("r1", prompt) == 0
    reach = cached(router, prompt)
    assert reach == {"a": 5 * P, "b": 5 * P, "c": 0}  # b through the store, c not attached
    assert gpu(router, prompt) == {"a": 5 * P, "b": 0, "c": 0}  # a holds it itself
    only = {s.name: s.store_tokens for s in router.lookup(NS, prompt).scores}
    assert only == {"a": 0, "b": 5 * P, "c": 0}  # the policies rank a store's reach last
    assert router.route(NS, prompt, "q").replica == "a"  # local hits first
    b = Runtime("b", store, subscriber)  # b does load it
    assert b.serve("r2", prompt) == 5 * P
    a.close()
    b.close()


def test_blocks_the_store_evicts_leave_every_replicas_reach(fleet):
    router, subscriber, store = fleet
    a = Runtime("a", store, subscriber)
    first = np.arange(1000, 1000 + 4 * P + 1, dtype=np.int32)
    a.serve("r1", first)
    assert cached(router, first)["b"] == 4 * P
    # a 1 MiB store holds 7 blocks: writing others evicts the first prompt's
    for i in range(12):
        other = np.arange(5000 + 1000 * i, 5000 + 1000 * i + 8 * P + 1, dtype=np.int32)
        a.serve(f"o{i}", other)
    assert store.evicted() > 0
    assert cached(router, first)["b"] < 4 * P  # b's reach went with the evicted blocks
    a.close()


def test_a_replica_holding_a_prefix_on_host_comes_before_one_reaching_it_in_a_store():
    from prefixcache.fleet.policies import POLICIES, ReplicaScore, RouteContext, RoutingParams

    host = ReplicaScore("host", 64, 0, 0, 0, 100, 10)  # all 64 tokens in its host memory
    pool = ReplicaScore("pool", 64, 0, 0, 0, 100, 10, store_tokens=64)  # only in the store
    ctx = RouteContext(prompt_tokens=80, turn=1, params=RoutingParams())
    for name in ("prefix", "prefix_cost"):
        for order in ((host, pool), (pool, host)):
            assert POLICIES[name](order, ctx).replica == "host"
