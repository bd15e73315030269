"""The fleet index on a real Redis Cluster of three primaries (redis-server in cluster mode on
127.0.0.1): every key in the index's hash slot, shared by two routers, a failed slot owner."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from prefixcache.errors import ConfigError
from prefixcache.fleet.fleet_index import CPU, GPU, ReplicaMatch
from prefixcache.fleet.memory_index import MemoryFleetIndex
from prefixcache.fleet.open_index import open_index
from prefixcache.fleet.redis_index import RedisFleetIndex
from tests.fleet_support import RedisClusterNodes

PROMPT = [os.urandom(16) for _ in range(48)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (apt-get install redis-server)")
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster"))
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.kill()


def _open(cluster: RedisClusterNodes, **options: object) -> RedisFleetIndex:
    index = open_index(cluster.url, **options)
    assert isinstance(index, RedisFleetIndex)
    return index


def _writes(index: RedisFleetIndex | MemoryFleetIndex) -> None:
    for k in range(6):
        index.store(f"pod-{k}", PROMPT[: 8 * (k + 1)])
    index.remove("pod-2", PROMPT[10:], GPU)
    index.store("pod-2", PROMPT[:4], CPU)
    index.clear("pod-5")


def test_the_index_lives_in_one_slot_and_is_shared(cluster: RedisClusterNodes) -> None:
    index, truth = _open(cluster, prefix="{one}:fleet"), MemoryFleetIndex()
    for x in (index, truth):
        _writes(x)
    assert index.flush() and index.stats().errors == 0
    sizes = cluster.dbsizes()
    assert sum(1 for n in sizes if n) == 1  # every key on the node serving the tag's slot
    other = _open(cluster, prefix="{one}:fleet")  # a second router over the same cluster
    for x in (index, other):
        assert x.match(PROMPT) == truth.match(PROMPT)
        assert x.replicas() == truth.replicas()
        for rep in truth.replicas():
            assert x.num_blocks(rep) == truth.num_blocks(rep)
            assert x.holdings(rep) == truth.holdings(rep)
    assert other.match(PROMPT[:8])[0] == ReplicaMatch("pod-0", 8, 8)
    index.close()
    other.close()


def test_default_prefix_has_a_hash_tag_and_plain_ones_are_refused(
    cluster: RedisClusterNodes,
) -> None:
    index = _open(cluster)
    assert index.prefix == "{prefixcache:fleet}"
    index.store("pod", PROMPT[:3])
    assert index.match(PROMPT) == [ReplicaMatch("pod", 3, 3)]
    index.clear("pod")
    index.close()
    with pytest.raises(ConfigError, match="hash tag"):
        open_index(cluster.url, prefix="prefixcache:fleet")
    with pytest.raises(ConfigError, match="redis\\+cluster://host:port"):
        open_index(cluster.url + "/2")


def test_slot_owner_killed_and_restarted(cluster: RedisClusterNodes) -> None:
    # while the node serving the slot is down the index answers from its local view; once the
    # cluster is back it finds the node again and writes the view back (no persistence here)
    index = _open(cluster, prefix="{two}:fleet", retry_interval=0.0)
    truth = MemoryFleetIndex()
    for x in (index, truth):
        x.store("pod", PROMPT[:20])
    assert index.flush()
    owner = next(n for n, size in zip(cluster.nodes, cluster.dbsizes(), strict=True) if size)
    owner.kill()
    for x in (index, truth):
        x.remove("pod", PROMPT[12:], GPU)
        x.store("pod", PROMPT[:2], CPU)
    assert index.match(PROMPT) == truth.match(PROMPT)
    assert not index.stats().in_sync and index.stats().errors >= 1
    owner.start()  # same port and cluster config: it serves its slots again, empty
    cluster.wait_ok()
    assert index.flush() and index.stats().resyncs >= 1
    fresh = _open(cluster, prefix="{two}:fleet")
    assert fresh.match(PROMPT) == truth.match(PROMPT)
    assert fresh.holdings("pod") == truth.holdings("pod")
    fresh.close()
    index.close()
