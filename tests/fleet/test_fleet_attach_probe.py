"""The attach probe on a real fleet: three example replicas behind `prefixcache serve`, one as
configured, one whose engine hashes with another seed than the config's `engine_hash` says, one
running another block size. When each first answers its health probe, the service sends it a
probe prompt twice and names what differs; the operator can run it again on demand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fleet.fleet_processes import FLEET_EXAMPLE as FLEET
from tests.fleet.fleet_processes import load_fleet_example

run_fleet = load_fleet_example("run_fleet")


def _findings(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in row["probe"]["findings"]}


def test_the_attach_probe_names_a_wrong_seed_and_a_wrong_block_size(tmp_path: Path) -> None:
    procs = run_fleet.Processes(tmp_path)
    engines = {  # name -> (engine block size, its --engine-hash, the config's engine_hash)
        "healthy": (16, "vllm-sha256_cbor", "vllm-sha256_cbor"),
        "seeded": (16, "vllm-sha256_cbor", {"engine": "vllm", "algo": "sha256_cbor", "seed": "42"}),
        "wide": (32, None, None),
    }
    try:
        with httpx.Client(timeout=60.0) as client:
            replicas = []
            for name, (block, engine_hash, configured) in engines.items():
                port = run_fleet.free_port()
                args = [str(FLEET / "replica.py"), "--port", str(port), "--model",
                        run_fleet.MODEL, "--blocks", "64", "--block-size", str(block)]  # fmt: skip
                if engine_hash:
                    args += ["--engine-hash", engine_hash]
                proc = procs.start(name, args)
                url = f"http://127.0.0.1:{port}"
                health = run_fleet.wait_healthy(client, procs, name, proc, url)
                row = {
                    "name": name,
                    "url": url,
                    "events": health["events"],
                    "replay": health["replay"],
                    "model": run_fleet.MODEL,
                    "block_size": 16,
                    "capacity_blocks": 64,
                }
                if configured:
                    row["engine_hash"] = configured
                replicas.append(row)
            config = {
                "index": "memory",
                "routing": {"policy": "prefix"},
                "health": {"probe_interval_s": 0.5},
                "replicas": replicas,
            }
            path = tmp_path / "fleet.yaml"
            path.write_text(yaml.safe_dump(config))
            port = run_fleet.free_port()
            service = f"http://127.0.0.1:{port}"
            serve = procs.start(
                "serve",
                ["-m", "prefixcache", "serve", "--config", str(path), "--port", str(port),
                 "--log-level", "info"],
            )  # fmt: skip
            run_fleet.wait_healthy(client, procs, "serve", serve, service)

            deadline = time.monotonic() + 60
            while True:
                rows = {
                    r["name"]: r for r in client.get(f"{service}/v1/replicas").json()["replicas"]
                }
                if all(r["probe"] is not None for r in rows.values()):
                    break
                assert time.monotonic() < deadline, rows
                time.sleep(0.2)

            assert rows["healthy"]["probe"]["ok"], rows["healthy"]["probe"]
            assert set(_findings(rows["healthy"])) == {
                "cache report", "prefix hit", "events", "engine hash"
            }  # fmt: skip

            seeded = _findings(rows["seeded"])
            assert not rows["seeded"]["probe"]["ok"]
            assert seeded["events"]["ok"] and seeded["prefix hit"]["ok"]
            assert not seeded["engine hash"]["ok"]
            assert seeded["engine hash"]["detail"] == (
                "the engine hashes with seed None (configured: '42')"
            )

            wide = _findings(rows["wide"])
            assert not wide["prefix hit"]["ok"]
            assert (
                "block size looks like 32 or 64, the config says 16" in wide["prefix hit"]["detail"]
            )
            assert not wide["events"]["ok"]
            assert wide["events"]["detail"] == (
                "its events were skipped: block_size 32, expected 16"
            )
            log = procs.log("serve")
            assert "replica seeded: attach probe found: engine hash" in log
            assert "replica healthy" not in log  # an agreeing probe logs at info only

            again = client.post(f"{service}/v1/replicas/seeded/probe")
            assert again.status_code == 200 and not again.json()["ok"]
            assert client.post(f"{service}/v1/replicas/nobody/probe").status_code == 404
    finally:
        procs.stop_all()


ACME = "sk-acme-0123456789abcdef0000"
OPS = "sk-operator-0123456789abcdef"


def test_with_tenants_the_probe_names_an_engine_that_ignores_cache_salt(tmp_path: Path) -> None:
    procs = run_fleet.Processes(tmp_path)
    try:
        with httpx.Client(timeout=60.0) as client:
            port = run_fleet.free_port()
            url = f"http://127.0.0.1:{port}"
            args = ["-m", "tests.fleet.salt_blind_replica", "--port", str(port),
                    "--model", run_fleet.MODEL, "--blocks", "64", "--block-size", "16"]  # fmt: skip
            proc = procs.start("blind", args)
            health = run_fleet.wait_healthy(client, procs, "blind", proc, url)
            (tmp_path / "keys.yaml").write_text(
                f"{ACME}: acme\n{OPS}: {{role: operator, name: ops}}\n"
            )
            config = {
                "index": "memory",
                "auth": {"keys_file": "keys.yaml"},
                "health": {"probe_interval_s": 0.5},
                "replicas": [
                    {
                        "name": "blind",
                        "url": url,
                        "events": health["events"],
                        "replay": health["replay"],
                        "model": run_fleet.MODEL,
                        "block_size": 16,
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
                ["-m", "prefixcache", "serve", "--config", str(path), "--port", str(sport)],
            )
            run_fleet.wait_healthy(client, procs, "serve", serve, service)
            ops = {"authorization": f"Bearer {OPS}"}

            def probe() -> Any:
                rows = client.get(f"{service}/v1/replicas", headers=ops).json()["replicas"]
                return rows[0]["probe"]

            deadline = time.monotonic() + 60
            while probe() is None:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            found = {f["check"]: f for f in probe()["findings"]}
            assert not probe()["ok"]
            assert found["cache report"]["ok"] and found["prefix hit"]["ok"]
            assert not found["cache salt"]["ok"]
            assert found["cache salt"]["detail"].startswith(
                "the engine served 80 of 81 tokens of a prompt from the blocks another "
                "cache_salt cached: it ignores cache_salt"
            )
            assert not found["events"]["ok"]
            assert found["events"]["detail"] == (
                "its events name the probe's blocks without the request's cache_salt: the "
                "engine ignores cache_salt"
            )
            assert "replica blind: attach probe found: cache salt" in procs.log("serve")
    finally:
        procs.stop_all()
