"""Fleet indexes: the in-memory index against a dict-of-sets model, Redis against memory, and
Redis killed and restarted mid-stream."""

from __future__ import annotations

import os

import pytest
import redis
from fleet_support import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import ConfigError, FleetCapacityError, InvalidArgumentError
from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.index.compact import CompactFleetIndex
from prefixcache.fleet.index.from_url import open_index
from prefixcache.fleet.index.interface import AppliedBatch, EngineBlock, ReplicaMatch
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex
from prefixcache.medium import CPU, GPU

CHAIN = [bytes([k]) * 16 for k in range(12)]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "drop"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 11),
        st.integers(1, 12),
        st.sampled_from([GPU, CPU, None]),
    ),
    max_size=40,
)


def _apply(index, model, op) -> None:
    kind, rep, lo, hi, medium = op
    digests = CHAIN[lo:hi]
    if kind == "store":
        medium = medium or GPU
        index.store(rep, digests, medium)
        model.setdefault(rep, set()).update((d, medium) for d in digests)
    elif kind == "remove":
        index.remove(rep, digests, medium)
        if rep in model:
            model[rep] -= {(d, m) for d in digests for m in (GPU, CPU) if medium in (None, m)}
    elif kind == "clear":
        index.clear(rep)
        if rep in model:
            model[rep] = set()
    else:
        index.drop_replica(rep)
        model.pop(rep, None)


def _expected(model, digests):
    out = []
    for rep in sorted(model):
        held = model[rep]
        n = next(
            (i for i, d in enumerate(digests) if not {(d, GPU), (d, CPU)} & held), len(digests)
        )
        g = next((i for i, d in enumerate(digests) if (d, GPU) not in held), len(digests))
        out.append(ReplicaMatch(rep, n, g))
    return out


IN_PROCESS_INDEXES = (MemoryFleetIndex, CompactFleetIndex)


@pytest.mark.parametrize("kind", IN_PROCESS_INDEXES)
@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(0, 11))
def test_memory_index_equals_a_dict_of_sets(kind, ops, start):
    index, model = kind(), {}
    for op in ops:
        _apply(index, model, op)
    for digests in (CHAIN, CHAIN[start:], []):
        assert index.match(digests) == _expected(model, digests)
    assert index.replicas() == sorted(model)
    for rep in model:
        assert index.num_blocks(rep) == len({d for d, _ in model[rep]})
    gpu = {rep: len({d for d, m in model[rep] if m == GPU}) for rep in model}
    assert index.num_blocks_many(sorted(model), GPU) == gpu


@pytest.fixture
def redis_index(redis_server):
    index = RedisFleetIndex.from_url(redis_server.url, prefix=f"t{os.urandom(4).hex()}")
    yield index
    index.client.close()


@settings(max_examples=25, deadline=None)
@given(OPS)
def test_redis_and_memory_give_the_same_matches(redis_server, ops):
    redis_index = RedisFleetIndex.from_url(redis_server.url, prefix=f"h{os.urandom(4).hex()}")
    memory = MemoryFleetIndex()
    for op in ops:
        _apply(redis_index, {}, op)
        _apply(memory, {}, op)
    assert redis_index.match(CHAIN) == memory.match(CHAIN)
    assert redis_index.replicas() == memory.replicas()
    for rep in memory.replicas():
        assert redis_index.num_blocks(rep) == memory.num_blocks(rep)
    everyone = [*memory.replicas(), "never-seen"]
    counts = {rep: memory.num_blocks(rep) for rep in everyone}
    assert redis_index.num_blocks_many(everyone) == memory.num_blocks_many(everyone) == counts
    on_gpu = memory.num_blocks_many(everyone, GPU)
    assert redis_index.num_blocks_many(everyone, GPU) == on_gpu
    redis_index.client.close()


def test_two_router_instances_share_one_index(redis_server, redis_index):
    other = RedisFleetIndex.from_url(redis_server.url, prefix=redis_index.prefix)
    redis_index.store("pod", CHAIN[:5])
    assert redis_index.flush()  # writes are queued until a flush or a read
    assert other.match(CHAIN) == [ReplicaMatch("pod", 5, 5)]
    other.client.close()


def test_redis_killed_and_restarted_mid_stream_resyncs(redis_server):
    index = RedisFleetIndex.from_url(redis_server.url, retry_interval=0.0, pipeline_size=4)
    truth = MemoryFleetIndex()
    prompt = [os.urandom(16) for _ in range(64)]
    for k in range(8):
        for x in (index, truth):
            x.store(f"pod-{k}", prompt[: 8 * (k + 1)])
    assert index.flush()
    redis_server.kill()
    for k in range(8):  # writes while Redis is away: answered from the local view
        for x in (index, truth):
            x.remove(f"pod-{k}", prompt[4 * k :], GPU)
            x.store(f"pod-{k}", prompt[:2], CPU)
    assert index.match(prompt) == truth.match(prompt)
    stats = index.stats()
    assert stats.errors >= 1 and not stats.in_sync
    redis_server.start()  # empty: no persistence
    assert index.flush() and index.stats().resyncs == 1
    fresh = RedisFleetIndex.from_url(redis_server.url)  # another router: sees Redis only
    assert fresh.match(prompt) == truth.match(prompt)
    for k in range(8):
        assert fresh.holdings(f"pod-{k}") == truth.holdings(f"pod-{k}")
    fresh.client.close()
    index.client.close()


def test_a_replica_dropped_while_redis_is_away_is_dropped_there_by_the_resync(redis_server):
    index = RedisFleetIndex.from_url(redis_server.url, prefix=f"d{os.urandom(4).hex()}")
    index.retry_interval = 0.0
    chain = [os.urandom(16) for _ in range(5)]
    index.store("a", chain)
    index.store("b", chain[:2])
    assert index.flush()
    index.sync.failed(redis.ConnectionError("away"))  # as a failed write would
    index.drop_replica("a")
    assert index.flush()  # back: the resync writes the local view, and drops "a"
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=index.prefix)
    assert fresh.replicas() == ["b"]
    assert fresh.num_blocks_many(["a", "b"], GPU) == {"a": 0, "b": 2}
    assert fresh.match(chain) == [ReplicaMatch("b", 2, 2)]
    fresh.client.close()
    index.client.close()


def _empty(index: RedisFleetIndex) -> None:
    for key in index.client.scan_iter(f"{index.prefix}:*"):  # a restart without persistence
        index.client.delete(key)


def test_a_short_outage_sends_the_missed_writes_and_keeps_what_others_wrote(redis_server):
    # the resync cleared every replica this instance knew and wrote back only its own view:
    # blocks another router (or this one before a restart) indexed, and engine maps, were lost
    prefix = f"o{os.urandom(4).hex()}"
    chain = [os.urandom(16) for _ in range(6)]
    other = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    other.store("pod", chain[:4])
    other.remember("pod", [b"i1", b"i2"], chain[:2], 0)
    other.close()
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    index.store("pod", chain[4:5])
    assert index.flush()
    index.sync.failed(redis.ConnectionError("away"))  # Redis away, with its data
    index.store("pod", chain[5:6], CPU)
    index.remove("pod", chain[4:5], GPU)
    assert index.flush() and index.stats().resyncs == 1
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert set(fresh.holdings("pod")) == {*chain[:4], chain[5]}
    assert fresh.recall("pod", [b"i1", b"i3"]) == {b"i1": EngineBlock(chain[0], 0, 1)}
    for x in (fresh, index):
        x.close()


def test_redis_losing_its_data_between_two_flushes_is_noticed(redis_server):
    # no call failed, so the writes after went to an empty index as if nothing had happened
    prefix = f"l{os.urandom(4).hex()}"
    chain = [os.urandom(16) for _ in range(4)]
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    index.store("pod", chain[:3])
    assert index.flush()
    _empty(index)  # a restart without persistence
    index.store("pod", chain[3:])
    assert index.flush() and index.stats().resyncs == 1
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert set(fresh.holdings("pod")) == set(chain)
    for x in (fresh, index):
        x.close()


def test_after_redis_lost_its_data_each_router_adds_its_view_back(redis_server):
    # the second write-back cleared each replica first: a router that joined midway (its view
    # partial) wiped the first one's whole view
    prefix = f"u{os.urandom(4).hex()}"
    chain = [os.urandom(16) for _ in range(4)]
    full = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    full.store("pod", chain)
    assert full.flush()
    late = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    late.store("pod", chain[3:])  # it heard only the last store
    assert late.flush()
    _empty(full)
    for x in (full, late):
        x.store("pod", chain[:1], CPU)
        assert x.flush() and x.stats().resyncs == 1
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert set(fresh.holdings("pod")) == set(chain)
    for x in (fresh, full, late):
        x.close()


def test_a_read_notices_that_redis_lost_its_data(redis_server):
    # while no write came, lookups answered from an empty Redis
    prefix = f"r{os.urandom(4).hex()}"
    chain = [os.urandom(16) for _ in range(3)]
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    index.store("pod", chain)
    assert index.flush()
    _empty(index)
    assert index.match(chain) == [ReplicaMatch("pod", 3, 3)]  # from the local view meanwhile
    # the sender thread writes the view back, off the read's path
    wait_until(lambda: index.stats().resyncs == 1, what="the write-back")
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert fresh.match(chain) == [ReplicaMatch("pod", 3, 3)]
    fresh.close()
    index.close()


def test_a_router_that_never_reached_redis_keeps_what_redis_holds(redis_server):
    # its first flush failed, so it had no epoch: the resync took Redis for emptied and
    # cleared each replica it knew before writing its partial view
    prefix = f"s{os.urandom(4).hex()}"
    chain = [os.urandom(16) for _ in range(4)]
    first = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    first.store("pod", chain[:3])
    first.close()
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    index.sync.failed(redis.ConnectionError("paused"))  # as at its first flush
    index.store("pod", chain[3:])
    assert index.flush()
    fresh = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    assert set(fresh.holdings("pod")) == set(chain)
    for x in (fresh, index):
        x.close()


def test_the_last_applied_batch_never_goes_back_and_leaves_with_its_replica(redis_server):
    # a lagging router (or a write-back) wrote an older batch over a newer one; a dropped
    # replica's batch came back at the next flush
    prefix = f"a{os.urandom(4).hex()}"
    ahead = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    behind = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    ahead.store("pod", [os.urandom(16)])
    ahead.note_applied("pod", 9, 109.0)
    assert ahead.flush()
    behind.note_applied("pod", 7, 107.0)
    behind.store("pod", [os.urandom(16)])
    assert behind.flush()
    assert behind.last_applied("pod") == AppliedBatch(9, 109.0)
    behind.note_applied("pod", 2, 200.0)  # a new engine's stream: newer, though a lower number
    behind.store("pod", [os.urandom(16)])
    assert behind.flush() and ahead.last_applied("pod") == AppliedBatch(2, 200.0)
    ahead.drop_replica("pod")
    assert ahead.flush()
    ahead.store("other", [os.urandom(16)])
    assert ahead.flush() and ahead.client.get(f"{prefix}:s:pod") is None
    for x in (ahead, behind):
        x.close()


def test_engine_maps_are_written_back_after_redis_lost_its_data(redis_server):
    # only the holdings came back: a router restarted later could not map the removals of
    # blocks stored before the loss, and they stayed in Redis for good
    from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint

    prefix = f"m{os.urandom(4).hex()}"
    index = RedisFleetIndex.from_url(redis_server.url, prefix=prefix, retry_interval=0.0)
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod", block_size=4)])
    stored = kv_wire.WireBlockStored([11, 12], None, list(range(8)), 4, None, "GPU", None)
    sub.ingest("pod", 0, kv_wire.encode_batch(kv_wire.KVEventBatch(1.0, [stored])))
    assert index.flush()
    _empty(index)
    index.match([bytes(16)])  # a read notices the loss; the sender writes the view back
    wait_until(lambda: index.stats().resyncs == 1, what="the write-back")
    restarted = RedisFleetIndex.from_url(redis_server.url, prefix=prefix)
    block = restarted.recall("pod", [b"i12"])
    assert block is not None and block[b"i12"].position == 1 and block[b"i12"].media == 1
    for x in (restarted, index):
        x.close()


@pytest.mark.parametrize("kind", IN_PROCESS_INDEXES)
def test_limits_and_bad_input(kind):
    index = kind(max_replicas=2, max_blocks_per_replica=3)
    index.store("a", CHAIN[:5])
    assert index.num_blocks("a") == 3 and index.overflow("a") == 2
    assert index.match(CHAIN) == [ReplicaMatch("a", 3, 3)]
    index.store("b", CHAIN[:1])
    with pytest.raises(FleetCapacityError):
        index.store("c", CHAIN[:1])
    index.drop_replica("b")
    index.store("c", CHAIN[:1])  # the slot is reused
    assert index.match(CHAIN[:2]) == [ReplicaMatch("a", 2, 2), ReplicaMatch("c", 1, 1)]
    for bad in (
        lambda: index.store("a", [b"short"]),
        lambda: index.store("", CHAIN),
        lambda: index.store("a", CHAIN, "SSD"),
        lambda: index.match(b"x" * 16),
    ):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert index.num_blocks("a") == 3
    with pytest.raises(ConfigError):
        open_index("postgres://x")
    assert isinstance(open_index("memory"), MemoryFleetIndex)
    assert isinstance(open_index("memory+compact"), CompactFleetIndex)


@pytest.mark.parametrize("kind", IN_PROCESS_INDEXES)
def test_matches_run_while_the_ingestion_thread_adds_and_drops_replicas(kind) -> None:
    """The router matches outside any lock while the subscriber's thread registers replicas (on
    their first store) and drops them: no read may fail on a map changing under it."""
    import sys
    import threading

    index = kind()
    digests = [bytes([k]) * 16 for k in range(1, 9)]
    index.store("base", digests)
    errors: list[BaseException] = []
    done = threading.Event()

    def churn() -> None:
        try:
            for k in range(3000):
                index.store(f"pod-{k % 40}", digests[: 1 + k % 8])
                if k % 7 == 0:
                    index.drop_replica(f"pod-{(k // 7) % 40}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=churn)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    writer.start()
    try:
        while not done.is_set():
            for m in index.match(digests):
                assert 0 <= m.gpu_blocks <= m.blocks <= len(digests)
            index.holdings("base")
    except BaseException as exc:
        errors.append(exc)
    finally:
        writer.join()
        sys.setswitchinterval(interval)
    assert errors == []


def test_an_index_written_without_gpu_counters_counts_them_once(redis_server, redis_index):
    # an index written by the previous release has no per-replica GPU counter: it must not
    # start at 0 (and go negative on removals)
    redis_index.store("pod", CHAIN[:8])
    redis_index.store("pod", CHAIN[8:10], CPU)
    assert redis_index.flush()
    redis_index.client.delete(f"{redis_index.prefix}:g:pod")  # as an older release left it
    assert redis_index.num_blocks_many(["pod"], GPU) == {"pod": 8}
    redis_index.client.delete(f"{redis_index.prefix}:g:pod")
    redis_index.remove("pod", CHAIN[:3])
    redis_index.store("pod", CHAIN[10:12])
    assert redis_index.num_blocks_many(["pod"], GPU) == {"pod": 7}
    assert redis_index.num_blocks_many(["pod"], GPU) == redis_index.local.num_blocks_many(
        ["pod"], GPU
    )
