"""Operator scenarios on a real fleet: every part killed, paused or restarted, the index then
equal to what each replica holds.

Each scenario starts two replicas of ``examples/fleet/replica.py`` (real caches; KV events over
ZMQ with vLLM's ``sha256_cbor`` block hashes, a replay buffer of a few batches); ``prefixcache
serve`` routers (memory index, or a redis-server started here for the module) come and go. Each
scenario ends by asking every replica which leading blocks of every prompt it holds (``/held``)
and the router the same (``/v1/lookup``): equal, nothing stale, nothing missing. Where the
router cannot have seen a prefix (it joined past the replay buffer), the documented one request
per prefix comes first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fleet_support import RedisServer, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
MODEL = "tiny-random"
ENGINE_HASH = "vllm-sha256_cbor"
BUFFER_STEPS = 4  # replay buffer of each replica, in batches
START_S = 60.0
SYNC_S = 20.0


class Proc:
    """A subprocess that can be killed, paused, resumed and started again with the same
    arguments (so on the same ports)."""

    def __init__(self, name: str, args: Sequence[str], health: str, log: Path) -> None:
        self.name, self.args, self.health, self.log = name, list(args), health, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return httpx.get(self.health, timeout=1.0).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, f"{self.name} to answer", START_S)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)  # a paused one too
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class Replica(Proc):
    def __init__(self, name: str, log_dir: Path) -> None:
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, str(ROOT / "examples" / "fleet" / "replica.py")]
        args += ["--port", str(self.port), "--model", MODEL, "--blocks", "40"]
        args += ["--events", f"tcp://127.0.0.1:{self.events}"]
        args += ["--replay", f"tcp://127.0.0.1:{self.replay}"]
        args += ["--engine-hash", ENGINE_HASH, "--buffer-steps", str(BUFFER_STEPS)]
        super().__init__(name, args, f"{self.url}/healthz", log_dir / f"{name}.log")

    def serve(self, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text

    def held(self, prompt: list[int]) -> int:
        resp = httpx.post(f"{self.url}/held", json={"prompt": prompt}, timeout=10)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["blocks"])


class Fleet:
    """The module's replicas, the prompts sent so far, and the routers of a test."""

    def __init__(self, replicas: list[Replica], log_dir: Path) -> None:
        self.replicas = replicas
        self.log_dir = log_dir
        self.prompts: list[list[int]] = []
        self.routers: list[Proc] = []
        self._n = 0

    def serve(self, replica: Replica, prompt: list[int]) -> None:
        replica.serve(prompt)
        self.prompts.append(prompt)

    def router(self, index: str) -> Proc:
        self._n += 1
        port = free_port()
        config = {
            "index": index,
            "routing": {"policy": "prefix"},
            "health": {"probe_interval_s": None},
            "limits": {"replay_deadline_s": 2, "redis_read_timeout_s": 0.5},
            "replicas": [
                {
                    "name": r.name,
                    "url": r.url,
                    "events": f"tcp://127.0.0.1:{r.events}",
                    "replay": f"tcp://127.0.0.1:{r.replay}",
                    "model": MODEL,
                    "block_size": BLOCK,
                    "capacity_blocks": 40,
                    "engine_hash": ENGINE_HASH,
                }
                for r in self.replicas
            ],
        }
        path = self.log_dir / f"router-{self._n}.yaml"
        path.write_text(yaml.safe_dump(config))
        args = [sys.executable, "-m", "prefixcache", "serve", "--config", str(path)]
        args += ["--port", str(port)]
        proc = Proc(f"router-{self._n}", args, f"http://127.0.0.1:{port}/healthz", path)
        proc.log = self.log_dir / f"router-{self._n}.log"
        proc.start()
        self.routers.append(proc)
        return proc

    def probes(self) -> list[list[int]]:
        """Every prompt sent, once. Its prefixes need no probe of their own: the replica's
        answer and the router's are both the leading blocks held, so they agree on a prefix
        of ``p`` when they agree on ``p``."""
        return [list(p) for p in dict.fromkeys(tuple(p) for p in self.prompts)]

    def differences(self, router: Proc) -> list[str]:
        base = router.health.rsplit("/", 1)[0]
        diffs = []
        with httpx.Client(timeout=10) as client:
            for prompt in self.probes():
                body = client.post(
                    f"{base}/v1/lookup", json={"model": MODEL, "tokens": prompt}
                ).json()
                seen = {s["name"]: s["cached_tokens"] // BLOCK for s in body["replicas"]}
                for r in self.replicas:
                    truth = r.held(prompt)
                    if seen.get(r.name) != truth:
                        diffs.append(
                            f"{r.name}: {len(prompt) // BLOCK}-block prompt {prompt[:3]}: "
                            f"router {seen.get(r.name)}, replica {truth}"
                        )
        return diffs

    def assert_index_equals_replicas(self, router: Proc) -> None:
        """Wait until the router's view equals every replica's cache; fail with the
        differences past the deadline."""
        last: list[str] = []

        def equal() -> bool:
            last[:] = self.differences(router)
            return not last

        try:
            wait_until(equal, "the index to equal the replicas' caches", SYNC_S)
        except AssertionError:
            base = router.health.rsplit("/", 1)[0]
            ingest = [
                line
                for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
                if line.startswith(("prefixcache_ingest_", "prefixcache_index_"))
            ]
            raise AssertionError(
                f"{router.name}'s index != replicas:\n" + "\n".join(last[:12] + ingest)
            ) from None

    def stop_routers(self) -> None:
        for router in self.routers:
            router.kill()
        self.routers.clear()


def _prompt(seed: int, blocks: int, tail: int = 5) -> list[int]:
    return [(seed * 37 + i * 11) % 251 for i in range(blocks * BLOCK + tail)]


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("operator")
    replicas = [Replica(name, log_dir) for name in ("a", "b")]
    fleet = Fleet(replicas, log_dir)
    try:
        for r in replicas:
            r.start()
        yield fleet
    finally:
        fleet.stop_routers()
        for r in replicas:
            r.kill()


@pytest.fixture
def routers(fleet: Fleet) -> Iterator[Fleet]:
    try:
        yield fleet
    finally:
        fleet.stop_routers()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.kill()


def _warm(fleet: Fleet, seed: int) -> None:
    """Each replica caches two prompts of its own and one both share."""
    a, b = fleet.replicas
    fleet.serve(a, _prompt(seed, 4))
    fleet.serve(b, _prompt(seed + 1, 3))
    shared = _prompt(seed + 2, 3)
    fleet.serve(a, shared)
    fleet.serve(b, shared + _prompt(seed + 3, 1))


def _catch_up(fleet: Fleet) -> None:
    """The documented rule for a router that joined past the replay buffer: one request per
    prefix a replica holds (its new block names a parent the router never saw; the router's
    engine hashes then place the whole prefix). A request can evict the tail of a prefix not
    asked for yet: what is left of it is asked for in the next round; what is left of a prefix
    already asked for stays known (its removed blocks vouched for their ancestors)."""
    asked: dict[str, list[tuple[int, ...]]] = {r.name: [] for r in fleet.replicas}

    def covered(r: Replica, prefix: tuple[int, ...]) -> bool:
        return any(q[: len(prefix)] == prefix for q in asked[r.name])

    for _ in range(10):
        todo = []
        for r in fleet.replicas:
            held = {tuple(p[: r.held(p) * BLOCK]) for p in fleet.prompts} - {()}
            longest = [p for p in held if not any(q[: len(p)] == p and q != p for q in held)]
            todo += [(r, p) for p in longest if not covered(r, p)]
        if not todo:
            return
        for r, prefix in todo:
            if r.held(list(prefix)) * BLOCK == len(prefix):  # not shortened meanwhile
                fresh = _prompt(1000 + len(fleet.prompts), 1, 0)  # a block it never stored
                fleet.serve(r, [*prefix, *fresh])
                asked[r.name].append((*prefix, *fresh))  # known whole: its new block vouches
    raise AssertionError("the catch-up did not settle in 10 rounds")


def _join(fleet: Fleet, index: str) -> Proc:
    """A new router on ``index``, subscribed, and caught up on what the replicas held before
    it came (earlier scenarios)."""
    router = fleet.router(index)
    _heard(fleet, router)
    _catch_up(fleet)
    fleet.assert_index_equals_replicas(router)
    return router


def _heard(fleet: Fleet, router: Proc) -> None:
    """Until the router's subscriptions are up (a PUB drops what it sends before): a prompt
    served by each replica shows in the index."""
    base = router.health.rsplit("/", 1)[0]
    for k, r in enumerate(fleet.replicas):

        def seen(r: Replica = r, k: int = k) -> bool:
            probe = _prompt(900 + k + 10 * len(fleet.prompts), 1, 0)
            fleet.serve(r, probe)
            body = httpx.post(
                f"{base}/v1/lookup", json={"model": MODEL, "tokens": probe}, timeout=10
            ).json()
            return any(s["name"] == r.name and s["cached_tokens"] for s in body["replicas"])

        wait_until(seen, f"{router.name} to hear {r.name}", SYNC_S)


# ---- replicas ------------------------------------------------------------------------------


def test_a_replica_killed_and_restarted_empty(routers: Fleet) -> None:
    fleet = routers
    router = _join(fleet, "memory")
    _warm(fleet, 10)
    fleet.assert_index_equals_replicas(router)
    a = fleet.replicas[0]
    a.kill()
    a.start()  # same ports, an empty cache, sequence numbers from 0 again
    # a new PUB's first batches can go before the router's SUB has reconnected: the router
    # notices the restart at the first batch it hears from the new stream
    _heard(fleet, router)
    fleet.serve(a, _prompt(20, 2))
    fleet.assert_index_equals_replicas(router)


def test_a_replica_paused_and_resumed(routers: Fleet) -> None:
    fleet = routers
    router = _join(fleet, "memory")
    _warm(fleet, 30)
    b = fleet.replicas[1]
    b.signal(signal.SIGSTOP)
    try:
        fleet.serve(fleet.replicas[0], _prompt(40, 3))
        time.sleep(1.0)  # b stays paused a while (its sockets silent), then goes on
    finally:
        b.signal(signal.SIGCONT)
    fleet.serve(b, _prompt(41, 5))  # evicts some of b's blocks
    fleet.assert_index_equals_replicas(router)


# ---- routers -------------------------------------------------------------------------------


def test_a_router_killed_and_a_new_one_started_past_the_replay_buffer(routers: Fleet) -> None:
    fleet = routers
    first = _join(fleet, "memory")
    _warm(fleet, 50)
    fleet.assert_index_equals_replicas(first)
    first.kill()
    for k in range(BUFFER_STEPS + 2):  # the replicas go on past their replay buffers
        fleet.serve(fleet.replicas[k % 2], _prompt(60 + k, 2))
    second = fleet.router("memory")
    _heard(fleet, second)
    _catch_up(fleet)
    fleet.assert_index_equals_replicas(second)


# ---- Redis ---------------------------------------------------------------------------------


def test_redis_killed_and_restarted_empty(routers: Fleet, redis: RedisServer) -> None:
    fleet = routers
    router = _join(fleet, redis.url)
    _warm(fleet, 80)
    fleet.assert_index_equals_replicas(router)
    redis.kill()
    fleet.serve(fleet.replicas[0], _prompt(90, 2))  # while Redis is away
    redis.start()  # empty, same port
    fleet.serve(fleet.replicas[1], _prompt(91, 2))
    fleet.assert_index_equals_replicas(router)
    _assert_in_sync(router)


def test_redis_paused_and_resumed(routers: Fleet, redis: RedisServer) -> None:
    fleet = routers
    first = _join(fleet, redis.url)
    _warm(fleet, 100)
    fleet.assert_index_equals_replicas(first)
    first.kill()  # its successor inherits the index in Redis (what the replicas held)
    router = _join(fleet, redis.url)
    fleet.serve(fleet.replicas[1], _prompt(105, 1))
    fleet.assert_index_equals_replicas(router)
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        fleet.serve(fleet.replicas[0], _prompt(110, 2))
        fleet.serve(fleet.replicas[1], _prompt(111, 3))
        # answered from the router's own view while Redis hangs
        fleet.assert_index_equals_replicas(router)
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    fleet.serve(fleet.replicas[0], _prompt(112, 1))
    fleet.assert_index_equals_replicas(router)
    _assert_in_sync(router)


def _assert_in_sync(router: Proc) -> None:
    base = router.health.rsplit("/", 1)[0]

    def in_sync() -> bool:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        return "prefixcache_index_in_sync 1.0" in text

    wait_until(in_sync, "the Redis index back in sync", SYNC_S)
