"""A replica that restarts comes back empty: the service drops its blocks from the index before it
takes routes again, and probes it again. On a real fleet: an example replica (KV events over real
ZMQ sockets) behind `prefixcache serve --proxy`, killed and started again on the same ports."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fleet.fleet_processes import FLEET_EXAMPLE as FLEET
from tests.fleet.fleet_processes import load_fleet_example

run_fleet = load_fleet_example("run_fleet")
BLOCK = 16
PROMPT = list(range(1, 5 * BLOCK + 2))  # five full blocks and one token


def _wait(check: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _cached(client: httpx.Client, service: str) -> dict[str, int]:
    body = {"model": run_fleet.MODEL, "tokens": PROMPT}
    scores = client.post(f"{service}/v1/lookup", json=body).json()["replicas"]
    return {s["name"]: s["cached_tokens"] for s in scores}


def _row(client: httpx.Client, service: str, name: str) -> dict[str, Any]:
    rows = client.get(f"{service}/v1/replicas").json()["replicas"]
    return next(r for r in rows if r["name"] == name)


@contextlib.contextmanager
def _fleet(tmp_path: Path) -> Iterator[tuple[Any, Any, httpx.Client, str, list[str]]]:
    """One example replica (KV events on fixed ports) behind `prefixcache serve --proxy`,
    probed every 0.2 s; yields the processes, the replica's process, a client, the service's
    URL and the replica's command line (to start it again)."""
    procs = run_fleet.Processes(tmp_path)
    port, events, replay = (run_fleet.free_port() for _ in range(3))
    replica_args = [
        str(FLEET / "replica.py"), "--port", str(port), "--model", run_fleet.MODEL,
        "--blocks", "64", "--block-size", str(BLOCK),
        "--events", f"tcp://127.0.0.1:{events}", "--replay", f"tcp://127.0.0.1:{replay}",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=60.0) as client:
            replica = procs.start("replica", replica_args)
            run_fleet.wait_healthy(client, procs, "replica", replica, url)
            config = {
                "index": "memory",
                "proxy": {"enabled": True},
                "health": {"probe_interval_s": 0.2, "probe_timeout_s": 0.5, "down_s": 1.0},
                "replicas": [
                    {
                        "name": "a",
                        "url": url,
                        "events": f"tcp://127.0.0.1:{events}",
                        "replay": f"tcp://127.0.0.1:{replay}",
                        "model": run_fleet.MODEL,
                        "block_size": BLOCK,
                        "capacity_blocks": 64,
                    }
                ],
            }
            path = tmp_path / "fleet.yaml"
            path.write_text(yaml.safe_dump(config))
            sport = run_fleet.free_port()
            service = f"http://127.0.0.1:{sport}"
            serve = procs.start(
                "serve",
                ["-m", "prefixcache", "serve", "--config", str(path), "--port", str(sport),
                 "--proxy", "--log-level", "info"],
            )  # fmt: skip
            run_fleet.wait_healthy(client, procs, "serve", serve, service)
            yield procs, replica, client, service, replica_args
    finally:
        procs.stop_all()


def _served_once(client: httpx.Client, service: str) -> dict[str, Any]:
    """The attach probe's first result, once the prompt's blocks are in the index."""
    first = _wait(lambda: _row(client, service, "a")["probe"], "the attach probe")
    assert first["ok"], first
    body = {"model": run_fleet.MODEL, "prompt": PROMPT, "max_tokens": 1}
    assert client.post(f"{service}/v1/completions", json=body).status_code == 200
    _wait(lambda: _cached(client, service)["a"] == 5 * BLOCK, "the prompt's blocks")
    return dict(first)


def test_a_restarted_replica_loses_its_blocks_before_it_takes_routes(tmp_path: Path) -> None:
    with _fleet(tmp_path) as (procs, replica, client, service, replica_args):
        first = _served_once(client, service)
        replica.kill()  # a crash: nothing published on the way out
        replica.wait()
        _wait(lambda: not _row(client, service, "a")["up"], "the replica to go down")
        again = procs.start("replica-again", replica_args)
        url = _row(client, service, "a")["url"]
        run_fleet.wait_healthy(client, procs, "replica-again", again, url)
        _wait(lambda: _row(client, service, "a")["up"], "the replica to come back")
        # up again: its cache is empty, and so is the index's view of it
        assert _cached(client, service) == {"a": 0}
        second = _wait(
            lambda: (p := _row(client, service, "a")["probe"])["at"] > first["at"] and p,
            "the attach probe to run again",
        )
        assert second["ok"], second
        body = {"model": run_fleet.MODEL, "prompt": PROMPT, "max_tokens": 1}
        answer = client.post(f"{service}/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "replica a restarted" in procs.log("serve")


def test_a_replica_that_was_only_unreachable_keeps_its_blocks(tmp_path: Path) -> None:
    with _fleet(tmp_path) as (procs, replica, client, service, _):
        first = _served_once(client, service)
        replica.send_signal(signal.SIGSTOP)  # frozen: its probes time out, its cache stays
        try:
            _wait(lambda: not _row(client, service, "a")["up"], "the replica to go down")
        finally:
            replica.send_signal(signal.SIGCONT)
        _wait(lambda: _row(client, service, "a")["up"], "the replica to come back")
        assert _cached(client, service) == {"a": 5 * BLOCK}
        assert _row(client, service, "a")["probe"]["at"] == first["at"]  # not probed again
        body = {"model": run_fleet.MODEL, "prompt": PROMPT, "max_tokens": 1}
        answer = client.post(f"{service}/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
        assert "restarted" not in procs.log("serve")
