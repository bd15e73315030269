"""A slowloris from many addresses against ``prefixcache serve`` (a subprocess): another process
(``slowloris_client``) holds partial requests from 24 loopback addresses, more than the service
serves, and opens a new one for each the service answers or closes. A load balancer's health
checks from one address and a fresh client's routes from another, each on a new connection, are
all answered 200: health is never refused for connection pressure, and a new client keeps its
share, the service closing the oldest partial requests of the addresses holding the most."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fleet.fleet_processes import ROOT, running
from tests.fleet_support import free_port, wait_until

PROBE = "127.0.0.1"  # the load balancer's health checks
FRESH = "127.0.0.3"  # a client that comes while the attack goes on
ADDRESSES = 24  # the attacker's: 127.0.0.10 onwards
PER_ADDRESS = 12  # 288 partial requests, past the 200 connections served and their headroom
MAX_CONNECTIONS = 200
PROBES = 40
ROUTE = {"model": "m", "tokens": [1, 2, 3, 4, 5, 6, 7, 8]}


@contextlib.contextmanager
def _attack(port: int, log: Path) -> Iterator[Path]:
    """The attacker process, reporting to ``log`` until it is stopped."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet.service.slowloris_client", "--port", str(port)]
            + ["--addresses", str(ADDRESSES), "--per-address", str(PER_ADDRESS)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield log
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _last_counts(log: Path) -> dict[str, float]:
    """The attacker's last report: held, opened, answered, failed (and seconds, per_s at the
    end)."""
    lines = [line for line in log.read_text().splitlines() if line.startswith(("held", "total"))]
    if not lines:
        return {}
    words = lines[-1].removeprefix("total ").split()
    return {words[k]: float(words[k + 1]) for k in range(0, len(words) - 1, 2)}


def _status(base: str, source: str, route: bool) -> str:
    """One request from ``source`` on a new connection: its status, or why there was none."""
    transport = httpx.HTTPTransport(local_address=source)
    try:
        with httpx.Client(transport=transport, timeout=5.0) as client:
            if route:
                return str(client.post(f"{base}/v1/route", json=ROUTE).status_code)
            return str(client.get(f"{base}/health").status_code)
    except httpx.TransportError as exc:
        return type(exc).__name__  # refused, closed unanswered, reset


@pytest.mark.skipif(sys.platform != "linux", reason="clients from 127.0.0.x need Linux's loopback")
def test_health_and_a_fresh_clients_routes_are_answered_through_a_slowloris_from_many_addresses(
    tmp_path: Path,
) -> None:
    config = {
        "index": "memory",
        "health": {"probe_interval_s": None},
        "server": {"max_connections": MAX_CONNECTIONS},
        "replicas": [
            {"name": "r1", "model": "m", "block_size": 4},
            {"name": "r2", "model": "m", "block_size": 4},
        ],
    }
    (tmp_path / "fleet.yaml").write_text(json.dumps(config))
    port = free_port()
    args = ["prefixcache", "serve", "--config", str(tmp_path / "fleet.yaml"), "--port", str(port)]
    with running(args, port, tmp_path / "service.log") as base:
        with _attack(port, tmp_path / "attack.log") as log:
            # the attack holds what the service serves and goes on opening what it answers
            wait_until(
                lambda: _last_counts(log).get("answered", 0) >= ADDRESSES * PER_ADDRESS,
                what="the attack to fill the service and keep opening",
                timeout=60.0,
            )
            health = [_status(base, PROBE, route=False) for _ in range(PROBES)]
            routes = [_status(base, FRESH, route=True) for _ in range(PROBES)]
            during = _last_counts(log)
        attack = _last_counts(log)
        refused_health = [s for s in health if s != "200"]
        refused_routes = [s for s in routes if s != "200"]
        print(
            f"health checks refused {len(refused_health)} of {PROBES} ({sorted(set(health))}), "
            f"a fresh client's routes refused {len(refused_routes)} of {PROBES} "
            f"({sorted(set(routes))}); the attack: {attack}"
        )
        assert refused_health == [], f"{len(refused_health)} of {PROBES} health checks refused"
        assert refused_routes == [], f"{len(refused_routes)} of {PROBES} fresh routes refused"
        assert during["held"] >= MAX_CONNECTIONS // 2  # the attack did hold its share
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        evicted = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("prefixcache_connections_evicted_total ")
        )
        assert evicted > 0  # room was made by closing partial requests, not by refusing
        # once it stops, the service answers at once
        assert _status(base, PROBE, route=False) == "200"
        assert _status(base, FRESH, route=True) == "200"
    log_text = (tmp_path / "service.log").read_text()
    assert "Traceback" not in log_text
