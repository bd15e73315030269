"""The fleet index on a real Redis Cluster (three primaries with a replica each, redis-server in
cluster mode on 127.0.0.1): every key in the index's hash slot, reached from a node that does
not serve it, shared by two routers, followed when the slot is resharded and when the node
named in the URL fails over."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import redis

from prefixcache.errors import ConfigError
from prefixcache.fleet.index.from_url import open_index
from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex
from prefixcache.medium import CPU, GPU
from tests.fleet_support import RedisClusterNodes, RedisServer, wait_until

PROMPT = [os.urandom(16) for _ in range(48)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (apt-get install redis-server)")
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.kill()


def _open(url: str, **options: object) -> RedisFleetIndex:
    index = open_index(url, **options)
    assert isinstance(index, RedisFleetIndex)
    return index


def _url(node: RedisServer) -> str:
    return f"redis+cluster://127.0.0.1:{node.port}"


def _other_primary(cluster: RedisClusterNodes, key: str) -> RedisServer:
    owner = cluster.node_of(key)
    client = redis.Redis(port=owner.port)
    try:
        ports = {int(s[2][1]) for s in client.cluster("slots")}
    finally:
        client.close()
    return next(n for n in cluster.nodes if n.port in ports and n is not owner)


def _writes(index: RedisFleetIndex | MemoryFleetIndex) -> None:
    for k in range(6):
        index.store(f"pod-{k}", PROMPT[: 8 * (k + 1)])
    index.remove("pod-2", PROMPT[10:], GPU)
    index.store("pod-2", PROMPT[:4], CPU)
    index.clear("pod-5")


def _same(index: RedisFleetIndex, truth: MemoryFleetIndex) -> None:
    assert index.match(PROMPT) == truth.match(PROMPT)
    assert index.replicas() == truth.replicas()
    for rep in truth.replicas():
        assert index.num_blocks(rep) == truth.num_blocks(rep)
        assert index.holdings(rep) == truth.holdings(rep)


def test_the_index_lives_in_one_slot_and_is_shared(cluster: RedisClusterNodes) -> None:
    # the URL names a primary that does not serve the index's slot: it is found from there
    url = _url(_other_primary(cluster, "{one}:fleet:replicas"))
    index, truth = _open(url, prefix="{one}:fleet"), MemoryFleetIndex()
    for x in (index, truth):
        _writes(x)
    assert index.flush() and index.stats().errors == 0
    owner = cluster.node_of("{one}:fleet:replicas")
    sizes = dict(zip([n.port for n in cluster.nodes], cluster.dbsizes(), strict=True))
    primaries_with_keys = [port for port, size in sizes.items() if size]
    assert owner.port in primaries_with_keys  # the owner (and its replica) hold every key
    other = _open(url, prefix="{one}:fleet")  # a second router over the same cluster
    _same(index, truth)
    _same(other, truth)
    assert other.match(PROMPT[:8])[0] == ReplicaMatch("pod-0", 8, 8)
    index.close()
    other.close()


def test_default_prefix_has_a_hash_tag_and_plain_ones_are_refused(
    cluster: RedisClusterNodes,
) -> None:
    index = _open(_url(cluster.nodes[0]))
    assert index.prefix == "{prefixcache:fleet}"
    index.store("pod", PROMPT[:3])
    assert index.match(PROMPT) == [ReplicaMatch("pod", 3, 3)]
    index.clear("pod")
    index.close()
    with pytest.raises(ConfigError, match="hash tag"):
        open_index(_url(cluster.nodes[0]), prefix="prefixcache:fleet")
    with pytest.raises(ConfigError, match="redis\\+cluster://host:port"):
        open_index(_url(cluster.nodes[0]) + "/2")


def _move_slot(cluster: RedisClusterNodes, key: str, target: RedisServer) -> None:
    """Migrate ``key``'s slot, keys included, to the primary ``target`` (a planned reshard)."""
    source = cluster.node_of(key)
    src, dst = redis.Redis(port=source.port), redis.Redis(port=target.port)
    try:
        slot = src.cluster("keyslot", key)
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        primaries = {int(s[2][1]) for s in src.cluster("slots")}
        for port in primaries:  # the replicas learn it from them
            with redis.Redis(port=port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    finally:
        src.close()
        dst.close()
    wait_until(lambda: cluster.node_of(key) is target, "the slot to move")


def test_a_resharded_slot_is_followed_without_a_failure(cluster: RedisClusterNodes) -> None:
    key = "{three}:fleet:replicas"
    url = _url(cluster.node_of(key))
    index, truth = _open(url, prefix="{three}:fleet"), MemoryFleetIndex()
    reader = _open(url, prefix="{three}:fleet")  # a router that only reads
    for x in (index, truth):
        _writes(x)
    assert index.flush()
    _move_slot(cluster, key, _other_primary(cluster, key))
    _same(reader, truth)  # MOVED: the reader finds the new node and answers from Redis
    index.store("pod-0", PROMPT[:1], CPU)
    truth.store("pod-0", PROMPT[:1], CPU)
    assert index.flush()
    _same(reader, truth)
    for x in (index, reader):
        assert x.stats().errors == 0 and x.stats().resyncs == 0 and x.stats().in_sync
    index.close()
    reader.close()


def test_failover_of_the_node_named_in_the_url(cluster: RedisClusterNodes) -> None:
    # the URL's node serves the slot and dies; its replica takes over and the index finds it
    key = "{two}:fleet:replicas"
    owner = cluster.node_of(key)
    index = _open(_url(owner), prefix="{two}:fleet", retry_interval=0.0)
    truth = MemoryFleetIndex()
    for x in (index, truth):
        x.store("pod", PROMPT[:20])
    assert index.flush()
    owner.kill()
    for x in (index, truth):
        x.remove("pod", PROMPT[12:], GPU)
        x.store("pod", PROMPT[:2], CPU)
    assert index.match(PROMPT) == truth.match(PROMPT)  # answered from the local view
    wait_until(lambda: cluster.node_of(key) is not owner, "the replica to take over", 30.0)
    wait_until(index.flush, "the index to reach the new primary", 30.0)
    assert index.stats().resyncs >= 1
    fresh = _open(_url(cluster.node_of(key)), prefix="{two}:fleet")
    _same(fresh, truth)
    fresh.close()
    index.close()
    owner.start()  # back as a replica of the new primary
    cluster.wait_ok()


def test_a_plain_redis_behind_a_cluster_url_is_refused(tmp_path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        with pytest.raises(ConfigError, match="not a cluster"):
            open_index(f"redis+cluster://127.0.0.1:{server.port}")
    finally:
        server.kill()


def test_engine_map_lookups_go_to_the_node_serving_the_slot(cluster: RedisClusterNodes) -> None:
    # the lookup script ran on the client it was registered with (the URL's node), not the one
    # serving the slot: it found nothing, and a joining router cleared the replica
    from prefixcache.fleet.index.interface import EngineBlock

    key = "{five}:fleet:replicas"
    index = _open(_url(_other_primary(cluster, key)), prefix="{five}:fleet")
    digest = os.urandom(16)
    index.store("r", [digest])
    index.remember("r", [b"i1"], [digest], 0)
    assert index.flush()
    assert index.recall("r", [b"i1"]) == {b"i1": EngineBlock(digest, 0, 1)}
    assert index.stats().errors == 0
    index.close()


def test_deployments_with_their_own_prefix_share_one_cluster(cluster: RedisClusterNodes) -> None:
    url = _url(cluster.nodes[0])
    team_a, team_b = _open(url + "?prefix={team-a}"), _open(url, prefix="{team-b}")
    assert (team_a.prefix, team_b.prefix) == ("{team-a}", "{team-b}")
    team_a.store("replica-0", PROMPT[:4])
    team_b.store("replica-0", PROMPT[:2])
    assert team_a.flush() and team_b.flush()
    fresh_a, fresh_b = _open(url, prefix="{team-a}"), _open(url + "?prefix={team-b}")
    assert fresh_a.match(PROMPT) == [ReplicaMatch("replica-0", 4, 4)]
    assert fresh_b.match(PROMPT) == [ReplicaMatch("replica-0", 2, 2)]
    team_a.drop_replica("replica-0")
    assert team_a.flush()
    assert fresh_a.replicas() == [] and fresh_b.replicas() == ["replica-0"]
    for index in (team_a, team_b, fresh_a, fresh_b):
        index.close()
