"""A slowloris from many addresses against ``prefixcache serve``: what a load balancer's health
checks and a fresh client get while it goes on.

    python bench/slowloris.py [--addresses 59] [--per-address 17] [--probes 40] [--repeats 3]
                              [--baseline-root DIR]

For each service (this checkout, and the one at ``--baseline-root`` when given, alternating round
by round), with the default limits (``server.max_connections`` 1000):

- ``prefixcache serve`` of that checkout in a subprocess on a free loopback port;
- the attacker, another process (``tests/fleet/service/slowloris_client.py``): from each of
  ``--addresses`` loopback addresses (127.0.0.10 onwards, each socket bound to its address) it
  holds ``--per-address`` partial requests (half a head trickled a byte every 3 s, half a whole
  head and 1 byte of its body) and opens a new one for each the service answers or closes;
- once the attack holds its connections (or 10 s have passed), ``--probes`` health checks
  (``GET /health`` from 127.0.0.1, a new connection each, given up after 2 s as a load
  balancer does) and as many routes of a fresh client (``POST /v1/route`` from 127.0.0.3, a new
  connection each, 5 s), alternating.

Printed per round: health checks failed (not 200, or no answer in time) and their p50 and max
latency, the fresh client's routes refused (not 200, or no answer), the connections the attacker
held and opened per second while the probes ran, and the service's counters of connections
closed to make room (``prefixcache_connections_evicted``) and refused
(``prefixcache_connections_closed_over_limit``). Target: no health check and no fresh route
refused.

DIR is a checkout of another commit, e.g. ``git archive <commit> | tar -x -C DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROBE = "127.0.0.1"
FRESH = "127.0.0.3"
ROUTE = {"model": "m", "tokens": list(range(64))}


def attacker_counts(log: Path) -> dict[str, float]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("held")]
    if not lines:
        return {}
    words = lines[-1].split()
    return {words[k]: float(words[k + 1]) for k in range(0, len(words) - 1, 2)}


def probe(base: str, source: str, route: bool) -> tuple[bool, float]:
    """One request on a new connection from ``source``: (answered 200, seconds)."""
    start = time.perf_counter()
    try:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=5.0 if route else 2.0) as client:
            if route:
                ok = client.post(f"{base}/v1/route", json=ROUTE).status_code == 200
            else:
                ok = client.get(f"{base}/health").status_code == 200
    except httpx.HTTPError:
        ok = False
    return ok, time.perf_counter() - start


def counter(base: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def run_round(root: Path, label: str, args: argparse.Namespace, work: Path) -> None:
    from tests.fleet_support import free_port

    config = {
        "index": "memory",
        "health": {"probe_interval_s": None},
        "replicas": [
            {"name": "r1", "model": "m", "block_size": 16},
            {"name": "r2", "model": "m", "block_size": 16},
        ],
    }
    cfg = work / "fleet.yaml"
    cfg.write_text(json.dumps(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(root)}
    with open(work / f"{label}.log", "ab") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "prefixcache", "serve", "--config", str(cfg)]
            + ["--port", str(port), "--log-level", "warning"],
            cwd=root,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    attack_log = work / f"{label}-attack.log"
    attacker = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if service.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{label}: the service did not start ({work / f'{label}.log'})")
            time.sleep(0.1)
        with open(attack_log, "wb") as out:
            attacker = subprocess.Popen(
                [sys.executable, "-m", "tests.fleet.service.slowloris_client"]
                + ["--port", str(port), "--addresses", str(args.addresses)]
                + ["--per-address", str(args.per_address)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        target = 0.9 * args.addresses * args.per_address
        deadline = time.monotonic() + 10
        while attacker_counts(attack_log).get("held", 0) < target:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        before = attacker_counts(attack_log)
        t0 = time.monotonic()
        health: list[tuple[bool, float]] = []
        routes: list[tuple[bool, float]] = []
        for _ in range(args.probes):
            health.append(probe(base, PROBE, route=False))
            routes.append(probe(base, FRESH, route=True))
        seconds = time.monotonic() - t0
        after = attacker_counts(attack_log)
    finally:
        if attacker is not None:
            attacker.terminate()
            attacker.wait(15)
    try:
        evicted = counter(base, "prefixcache_connections_evicted_total")
        refused = counter(base, "prefixcache_connections_closed_over_limit_total")
    finally:
        os.killpg(service.pid, signal.SIGTERM)
        try:
            service.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait(15)
    opened = after.get("opened", 0) - before.get("opened", 0)
    lat = sorted(t for _, t in health)
    print(
        f"{label:9s} health failed {sum(not ok for ok, _ in health):2d}/{len(health)} "
        f"(p50 {statistics.median(lat) * 1000:6.1f} ms, max {lat[-1] * 1000:7.1f} ms)  "
        f"fresh routes refused {sum(not ok for ok, _ in routes):2d}/{len(routes)}  "
        f"attacker held {after.get('held', 0):5.0f}, opened {opened / seconds:5.0f}/s  "
        f"evicted {evicted}  refused unanswered {refused}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addresses", type=int, default=59, help="attacking addresses (59)")
    parser.add_argument("--per-address", type=int, default=17, help="partial requests each (17)")
    parser.add_argument("--probes", type=int, default=40, help="health checks and routes (40)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per service (3)")
    parser.add_argument("--baseline-root", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    sides = [(ROOT, "candidate")]
    if args.baseline_root is not None:
        sides.append((args.baseline_root.resolve(), "baseline"))
    with tempfile.TemporaryDirectory(prefix="slowloris-") as tmp:
        for k in range(args.repeats):
            for root, label in sides if k % 2 == 0 else sides[::-1]:
                run_round(root, label, args, Path(tmp))


if __name__ == "__main__":
    main()
