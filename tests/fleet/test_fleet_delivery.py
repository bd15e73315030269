"""Predicted against delivered on a real fleet: three example replicas behind `prefixcache serve
--proxy`, each reporting its cached tokens in its answers as vLLM does. One runs with the block
size its config names (healthy), one with another block size, one publishes its KV events where
the service does not listen. Within the window the two go `degraded` with a reason naming what
to check, the healthy one never does; restarted as configured, both come back by themselves.
Attribution sums add up per request and per tenant; the live what-if curves and the dashboard
answer for the same traffic; the service records the routed requests as a trace
(`--record-trace`)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fleet.fleet_processes import FLEET_EXAMPLE as FLEET
from tests.fleet.fleet_processes import load_fleet_example

WINDOW = 24
MIN_REQUESTS = 12


run_fleet = load_fleet_example("run_fleet")


def _replica_args(port: int, block_size: int, events: str, replay: str) -> list[str]:
    return [
        str(FLEET / "replica.py"), "--port", str(port), "--model", run_fleet.MODEL,
        "--blocks", "128", "--block-size", str(block_size), "--events", events,
        "--replay", replay,
    ]  # fmt: skip


def _start(
    procs: Any, client: httpx.Client, name: str, port: int, block_size: int, events: str,
    replay: str,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:  # fmt: skip
    proc = procs.start(name, _replica_args(port, block_size, events, replay))
    return proc, run_fleet.wait_healthy(client, procs, name, proc, f"http://127.0.0.1:{port}")


def _start_free(
    procs: Any, client: httpx.Client, ports: dict[str, int], name: str, block_size: int,
    events: str, replay: str,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:  # fmt: skip
    """``_start`` on ``ports[name]``, or on another free port when something bound that one
    between its choice and the replica's bind (a replica started before it binds its ZMQ
    sockets on any port); ``ports`` says the port it runs on."""
    for attempt in range(3):
        try:
            return _start(procs, client, name, ports[name], block_size, events, replay)
        except RuntimeError:
            if attempt == 2 or "address already in use" not in procs.log(name):
                raise
            ports[name] = run_fleet.free_port()
    raise AssertionError("unreachable")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def _send(client: httpx.Client, service: str, prompts: list[list[int]], start: int) -> list[dict]:
    """Each prompt through the proxy (every fourth streamed with its usage chunk); the replica
    and the engine's cached tokens of each."""
    out = []
    for i, prompt in enumerate(prompts, start):
        body: dict[str, Any] = {"model": run_fleet.MODEL, "prompt": prompt, "max_tokens": 2}
        if i % 4 == 3:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", f"{service}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                replica = resp.headers["x-prefixcache-replica"]
                resp.read()
        else:
            resp = client.post(f"{service}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            replica = resp.headers["x-prefixcache-replica"]
        out.append({"replica": replica})
    return out


def _replicas(client: httpx.Client, service: str) -> dict[str, dict]:
    rows = client.get(f"{service}/v1/replicas").json()["replicas"]
    return {row["name"]: row for row in rows}


def test_degraded_replicas_are_named_with_a_reason_and_recover(tmp_path: Path) -> None:
    procs = run_fleet.Processes(tmp_path)
    free = run_fleet.free_port
    ports = {name: free() for name in ("healthy", "wrong-block", "silent")}
    quiet_events, quiet_replay = f"tcp://127.0.0.1:{free()}", f"tcp://127.0.0.1:{free()}"
    any_port = "tcp://127.0.0.1:*"
    try:
        with httpx.Client(timeout=60.0) as client:
            started = {
                "healthy": _start_free(procs, client, ports, "healthy", 16, any_port,
                                       any_port),
                "wrong-block": _start_free(procs, client, ports, "wrong-block", 32,
                                           any_port, any_port),
                "silent": _start_free(procs, client, ports, "silent", 16, any_port,
                                      any_port),
            }  # fmt: skip
            replicas = []
            for name, (_, health) in started.items():
                events, replay = health["events"], health["replay"]
                if name == "silent":  # the service listens where nothing publishes
                    events, replay = quiet_events, quiet_replay
                replicas.append(
                    {
                        "name": name,
                        "url": f"http://127.0.0.1:{ports[name]}",
                        "events": events,
                        "replay": replay,
                        "model": run_fleet.MODEL,
                        "block_size": 16,  # what the wrong-block replica should run with
                        "capacity_blocks": 128,
                    }
                )
            config = {
                "index": "memory",
                "routing": {"policy": "round_robin"},
                "proxy": {"enabled": True, "timeout_s": 60.0},
                "delivery": {"window": WINDOW, "min_requests": MIN_REQUESTS},
                "whatif": {"rate": 1.0},
                "health": {"probe_interval_s": None},
                "replicas": replicas,
            }
            path = tmp_path / "fleet.yaml"
            path.write_text(yaml.safe_dump(config))
            port = free()
            service = f"http://127.0.0.1:{port}"
            serve = procs.start(
                "serve",
                ["-m", "prefixcache", "serve", "--config", str(path), "--port", str(port),
                 "--proxy", "--log-level", "warning", "--record-trace",
                 str(tmp_path / "routed.jsonl")],
            )  # fmt: skip
            run_fleet.wait_healthy(client, procs, "serve", serve, service)

            workload = run_fleet.shared_prompt_workload(6 * WINDOW, num_systems=3, seed=3)
            prompts = workload.prompts
            sent = _send(client, service, prompts[: 3 * WINDOW], 0)
            rows = _replicas(client, service)
            assert not rows["healthy"]["degraded"], rows["healthy"]
            assert rows["healthy"]["delivery"]["requests"] == WINDOW
            for name in ("wrong-block", "silent"):
                row = rows[name]
                assert row["degraded"], row
                assert "did not know" in row["degraded_reason"]
                assert "block_size" in row["degraded_reason"]
                assert "events" in row["degraded_reason"]
            assert client.get(f"{service}/healthz").json()["replicas_degraded"] == 2
            assert client.get(f"{service}/health").headers["x-prefixcache-degraded"] == "2"
            metrics = client.get(f"{service}/metrics").text
            assert 'prefixcache_replica_degraded{replica="silent"} 1.0' in metrics
            assert 'prefixcache_replica_degraded{replica="healthy"} 0.0' in metrics
            assert "replica wrong-block degraded" in procs.log("serve")
            assert {s["replica"] for s in sent} == set(ports)

            # the live curves of the same traffic, and the page that draws them
            whatif = client.get(f"{service}/v1/whatif").json()
            assert whatif["window"]["routed_requests"] == 3 * WINDOW
            curves = {row["name"]: row for row in whatif["replicas"]}
            assert {name: row["requests"] for name, row in curves.items()} == {
                name: WINDOW for name in ports
            }
            for row in [*curves.values(), whatif["fleet"]]:
                rates = [point["token_hit_rate"] for point in row["points"]]
                assert len(rates) == 6 and rates == sorted(rates), row
            assert whatif["fleet"]["points"][-1]["token_hit_rate"] > 0.5  # shared prompts
            assert "what-if curves" in client.get(f"{service}/dashboard").text

            stats = client.get(f"{service}/v1/stats").json()
            (row,) = stats["attribution"]
            assert row["requests"] == 3 * WINDOW and stats["unreported_requests"] == 0
            assert row["available_tokens"] >= row["captured_tokens"]
            # the engines delivered more than the index knew of: two of them go unannounced
            assert row["delivered_tokens"] > row["captured_tokens"] > 0

            # fixed: restarted as configured, on the same ports; empty caches, known events
            _stop(started["wrong-block"][0])
            _stop(started["silent"][0])
            _start(procs, client, "wrong-block-fixed", ports["wrong-block"], 16,
                   replicas[1]["events"], replicas[1]["replay"])  # fmt: skip
            _start(procs, client, "silent-fixed", ports["silent"], 16, quiet_events, quiet_replay)
            time.sleep(1.0)  # the service's subscriptions reconnect
            _send(client, service, prompts[3 * WINDOW :], 3 * WINDOW)
            rows = _replicas(client, service)
            for name in ports:
                assert not rows[name]["degraded"], rows[name]
            assert rows["silent"]["delivery"]["degraded_times"] == 1
            assert "replica silent recovered" in procs.log("serve")
            assert client.get(f"{service}/healthz").json()["replicas_degraded"] == 0
        procs.stop_all()  # the service flushes its recorded trace as it stops
        routed = (tmp_path / "routed.jsonl").read_text().splitlines()
        assert len(routed) == len(prompts)  # every proxied request, none of the engines'
        assert all(json.loads(line)["input_length"] > 0 for line in routed)
    finally:
        procs.stop_all()
