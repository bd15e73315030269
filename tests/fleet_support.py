"""Helpers for the fleet tests: a redis-server per test module, free ports, truth from managers."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from prefixcache import CacheManager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_configs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What ``prefixcache serve`` would serve in one process: each uvicorn config is recorded
    (the app is ``config.app``) and the server reports itself started, without listening."""
    from prefixcache.fleet.service.transport import BatchedAcceptServer

    served: list[Any] = []

    def started(server: BatchedAcceptServer, sockets: object = None) -> None:
        served.append(server.config)
        server.started = True

    monkeypatch.setattr(BatchedAcceptServer, "run", started)
    return served


def wait_until(check: Callable[[], bool], what: str = "condition", timeout: float = 10.0) -> None:
    """Poll ``check()`` until it is true; fail naming ``what`` past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class RedisServer:
    """A throwaway redis-server (no persistence) that can be killed and restarted."""

    def __init__(self, workdir: Path, args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
                *self.args,
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class RedisClusterNodes:
    """A throwaway Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each (no
    persistence); a node can be killed and restarted on its port, keeping its place."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = []
        for _ in range(primaries * (1 + replicas)):
            node = RedisServer(workdir)
            node.args = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"]
            node.args += ["--cluster-config-file", f"nodes-{node.port}.conf"]
            node.args += ["--cluster-port", str(free_port())]  # the bus: not port + 10000
            node.args += ["--repl-diskless-sync-delay", "0"]  # replicas in sync at once
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-yes"]
            + ["--cluster-replicas", str(self.replicas)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def node_of(self, key: str) -> RedisServer:
        """The primary serving ``key``'s slot now."""
        import redis

        for node in self.nodes:
            if node.proc is None:
                continue
            client = redis.Redis(port=node.port)
            try:
                slot = client.cluster("keyslot", key)
                for start, end, primary, *_ in client.cluster("slots"):
                    if start <= slot <= end:
                        port = int(primary[1])
                        return next(n for n in self.nodes if n.port == port)
            finally:
                client.close()
        raise RuntimeError("no running node")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says the cluster is up and every replica is in sync."""

        def ok() -> bool:
            for node in self.nodes:
                if node.proc is None:
                    continue
                info = subprocess.run(
                    ["redis-cli", "-p", str(node.port), "cluster", "info"],
                    capture_output=True,
                    timeout=10,
                ).stdout
                replication = subprocess.run(
                    ["redis-cli", "-p", str(node.port), "info", "replication"],
                    capture_output=True,
                    timeout=10,
                ).stdout
                if b"cluster_state:ok" not in info:
                    return False
                if b"role:slave" in replication and b"master_link_status:up" not in replication:
                    return False
            return True

        wait_until(ok, "the Redis Cluster to be up", timeout)

    def dbsizes(self) -> list[int]:
        return [
            int(
                subprocess.run(
                    ["redis-cli", "-p", str(node.port), "dbsize"], capture_output=True, timeout=10
                ).stdout
            )
            for node in self.nodes
        ]

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def redis_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


def manager_digests(mgr: CacheManager) -> set[bytes]:
    """Every block digest the manager's index holds."""
    return {n.digest(i) for n in mgr.index.iter_nodes() for i in range(len(n.blocks))}


def exact_prefix_lru(
    chains: Sequence[Sequence[bytes]], lengths: Sequence[int], capacity: int, block_size: int
) -> float:
    """Token hit rate of an exact LRU of ``capacity`` blocks over prompts given as their full
    blocks' digests (root first) and lengths: a prompt hits the blocks in the cache when it
    arrives, then its blocks are referenced deepest first (what the what-if curves estimate)."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hit = total = 0
    for chain, length in zip(chains, lengths, strict=True):
        total += length
        hit += block_size * sum(d in cache for d in chain)
        for d in reversed(chain):
            if d in cache:
                cache.move_to_end(d)
            else:
                cache[d] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hit / total
