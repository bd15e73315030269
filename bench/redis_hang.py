"""Routes while Redis hangs: ``prefixcache serve`` over a Redis index, its replicas publishing KV
events over ZMQ, and redis-server stopped (SIGSTOP) for a while.

    python bench/redis_hang.py [--hang 30] [--rate 100] [--replicas 4] [--baseline-root DIR]

For each service (this checkout, and the one at ``--baseline-root`` when given, in turn), on a
redis-server of its own (a free loopback port, no persistence):

- the replicas are ``CacheManager``s in this script, each publishing its KV events with a
  ``KVEventPublisher`` on loopback ZMQ sockets (and a replay endpoint), serving a new prompt every
  ``1 / --publish`` seconds (a 256-token prefix of one of four families and 128 tokens of its
  own), so the service's subscriber writes to Redis all along, and stores and evictions keep
  coming while Redis hangs;
- ``prefixcache serve`` (a subprocess: ``python -m prefixcache serve`` of that checkout) follows
  them and keeps its index in the Redis (``--index redis://...``);
- a paced asyncio client posts ``/v1/route`` at ``--rate`` routes/s (route k is due at k / rate
  and its latency runs from then, so a stall delays and counts every route behind it): ``--warm``
  seconds with Redis answering, then ``--hang`` seconds with redis-server stopped (SIGSTOP), then
  ``--after`` seconds once it goes on (SIGCONT).

Printed per service and phase: routes, p50, p99 and max latency, routes over 100 ms and over 1 s,
answers other than 200; and whether the index was back in sync with Redis at the end
(``prefixcache_index_in_sync``). Targets while Redis hangs: p99 <= 100 ms, no route over 1 s.

DIR is a checkout of another commit, e.g. ``git archive <commit> | tar -x -C DIR`` (copy the
compiled ``prefixcache/*.so`` files and ``prefixcache/native_sources.sha256`` beside it to run
the same compiled core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = "bench-model"
BLOCK = 16


class PublishingFleet:
    """Replicas that serve new prompts and publish their KV events, on a thread of their own."""

    def __init__(self, replicas: int, interval: float) -> None:
        from prefixcache import CacheManager
        from prefixcache.fleet.events.publisher import KVEventPublisher

        self.names = [f"r{i}" for i in range(replicas)]
        self.managers = [CacheManager(2048, BLOCK) for _ in self.names]
        self.publishers = []
        for mgr in self.managers:
            pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            pub.attach(mgr)
            self.publishers.append(pub)
        rng = np.random.default_rng(0)
        self.families = [rng.integers(0, 128_000, 256).tolist() for _ in range(4)]
        self.interval = interval
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def config(self, index: str) -> dict[str, Any]:
        return {
            "index": index,
            "health": {"probe_interval_s": None},
            "replicas": [
                {
                    "name": name,
                    "model": MODEL,
                    "block_size": BLOCK,
                    "capacity_blocks": 2048,
                    "events": pub.endpoint,
                    "replay": pub.replay_endpoint,
                }
                for name, pub in zip(self.names, self.publishers, strict=True)
            ],
        }

    def serve_one(self) -> None:
        """Each replica serves one new prompt and publishes what its cache did."""
        from prefixcache import Namespace

        ns = Namespace(MODEL)
        rng = np.random.default_rng(self.served)
        for k, (mgr, pub) in enumerate(zip(self.managers, self.publishers, strict=True)):
            prompt = self.families[(self.served + k) % 4] + rng.integers(0, 128_000, 128).tolist()
            rid = f"q{self.served}-{k}"
            if mgr.block_counts().free < 40:
                mgr.evict(40)
            mgr.admit(rid, prompt, ns)
            mgr.release(rid)
            pub.flush()
        self.served += 1

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            self.serve_one()
            due += self.interval
            time.sleep(max(0.0, due - time.perf_counter()))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for pub in self.publishers:
            pub.close()


def route_bodies(families: list[list[int]], n: int) -> list[bytes]:
    rng = np.random.default_rng(1)
    return [
        json.dumps(
            {"model": MODEL, "tokens": families[k % 4] + rng.integers(0, 128_000, 64).tolist()}
        ).encode()
        for k in range(n)
    ]


def paced(base: str, bodies: list[bytes], rate: float, seconds: float) -> tuple[list[float], int]:
    """Latencies (from each route's due time) of ``rate * seconds`` routes, and how many were
    answered with anything but 200 (or not at all)."""
    import httpx

    total = int(rate * seconds)
    headers = {"content-type": "application/json"}

    async def main() -> tuple[list[float], int]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0) as client:
            start = time.perf_counter()
            lat: list[float] = []
            bad = 0

            async def one(k: int) -> None:
                nonlocal bad
                due = start + k / rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                try:
                    r = await client.post(
                        "/v1/route", content=bodies[k % len(bodies)], headers=headers
                    )
                    bad += r.status_code != 200
                except httpx.HTTPError:
                    bad += 1
                lat.append(time.perf_counter() - due)

            await asyncio.gather(*(one(k) for k in range(total)))
            return lat, bad

    return asyncio.run(main())


def figures(lat: list[float], bad: int) -> str:
    a = np.asarray(lat) * 1000
    return (
        f"{len(a):5d} routes  p50 {np.percentile(a, 50):7.1f} ms  p99 {np.percentile(a, 99):7.1f} "
        f"ms  max {a.max():7.1f} ms  >100 ms {int((a > 100).sum()):4d}  >1 s "
        f"{int((a > 1000).sum()):3d}  not 200 {bad}"
    )


def metric(base: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def run_side(root: Path, label: str, args: argparse.Namespace, work: Path) -> None:
    import httpx

    from tests.fleet_support import RedisServer, free_port

    redis_server = RedisServer(work)
    redis_server.start()
    fleet = PublishingFleet(args.replicas, 1.0 / args.publish)
    proc = None
    try:
        cfg = work / f"{label}.yaml"
        cfg.write_text(json.dumps(fleet.config(redis_server.url)))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(work / f"{label}.log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixcache", "serve", "--config", str(cfg)]
            + ["--port", str(port), "--log-level", "warning"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{label}: the service did not start: {(work / f'{label}.log')}")
            time.sleep(0.1)
        fleet.start()
        while True:  # until every replica's blocks are in the index
            rows = httpx.get(f"{base}/v1/replicas", timeout=10).json()
            rows = rows.get("replicas", rows) if isinstance(rows, dict) else rows
            if all(r.get("index_blocks", r.get("blocks", 0)) > 0 for r in rows):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{label}: the index stayed empty")
            time.sleep(0.2)
        bodies = route_bodies(fleet.families, 64)
        build = subprocess.run(
            [sys.executable, "-m", "prefixcache", "--version"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"{label} ({root}; {build})")
        warm = figures(*paced(base, bodies, args.rate, args.warm))
        print(f"  Redis answering {args.warm:4.0f} s: {warm}")
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            lat, bad = paced(base, bodies, args.rate, args.hang)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        print(f"  Redis stopped   {args.hang:4.0f} s: {figures(lat, bad)}")
        after = figures(*paced(base, bodies, args.rate, args.after))
        print(f"  Redis back      {args.after:4.0f} s: {after}")
        stored = metric(base, "prefixcache_ingest_blocks_stored_total")
        print(
            f"  in sync with Redis at the end: {metric(base, 'prefixcache_index_in_sync')}; "
            f"replicas served {fleet.served} prompts each; blocks stored (one replica) {stored}"
        )
    finally:
        fleet.close()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)
        redis_server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hang", type=float, default=30.0, help="seconds Redis is stopped (30)")
    parser.add_argument("--warm", type=float, default=5.0, help="seconds before the hang (5)")
    parser.add_argument("--after", type=float, default=5.0, help="seconds after it (5)")
    parser.add_argument("--rate", type=float, default=100.0, help="routes per second (100)")
    parser.add_argument("--replicas", type=int, default=4, help="publishing replicas (4)")
    parser.add_argument(
        "--publish", type=float, default=20.0, help="prompts per second per replica (20)"
    )
    parser.add_argument("--baseline-root", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    sides = [(ROOT, "candidate")]
    if args.baseline_root is not None:
        sides.append((args.baseline_root.resolve(), "baseline"))
    with tempfile.TemporaryDirectory(prefix="redis-hang-") as tmp:
        for root, label in sides:
            run_side(root, label, args, Path(tmp))


if __name__ == "__main__":
    main()
