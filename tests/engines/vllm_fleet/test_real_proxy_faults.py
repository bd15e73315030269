"""The proxy's faults against real vLLM: a replica that crashes (its requests go to the healthy
one, nothing is sent twice), comes back restarted (empty: its blocks leave the index before it
takes routes, and it is probed again), streams whose client closes right after ``data: [DONE]``
(their cached-token figures all counted), ``engine_hash: vllm`` (vLLM's default hashing), and
the attach probe with tenants (vLLM keeps ``cache_salt``s apart, so the salted probe agrees)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from real_fleet import (
    BLOCK,
    HTTP_TIMEOUT_S,
    MODEL,
    OPERATOR,
    bearer,
    complete,
    random_tokens,
    serving,
    wait_for,
)

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall, VLLMServer, free_port

ODD = "vllm-odd"


def _findings(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in row["probe"]["findings"]}


def test_a_crashed_replica_is_skipped_and_comes_back_empty_and_probed(
    fleet: VLLMFleet,
    odd_server: Callable[..., VLLMServer],
    odd_slot: VLLMFleet,
    vllm_install: VLLMInstall,
    tmp_path: Path,
) -> None:
    odd = odd_server(
        block_size=BLOCK, kv_cache_bytes=64 << 20, events=f"tcp://127.0.0.1:{free_port()}"
    )
    healthy = fleet["vllm-0"]
    # probes far apart: the crash is met by a request first; a refused replica stays down
    # until a probe finds it back
    health = {"probe_interval_s": 60.0, "probe_timeout_s": 2.0, "down_s": 3600.0}
    with serving(tmp_path, [healthy, odd], vllm_install.model, health=health) as service:
        first = service.wait_probed([ODD, healthy.name])[ODD]["probe"]
        prompt = random_tokens(6 * BLOCK + 5)
        # the prompt's blocks on the odd server only, as the index knows
        assert complete(odd.url, prompt).status_code == 200
        service.wait_held(odd, prompt)
        assert service.lookup(prompt)[ODD] == 6 * BLOCK

        os.killpg(odd.pid, signal.SIGKILL)  # crashed: nothing listens on its port any more
        odd.stop()  # every process of it reaped
        replica, delivered = service.proxied(prompt)  # before any probe has noticed
        assert replica == healthy.name and delivered == 0
        row = service.replicas()[ODD]
        assert not row["up"] and row["down_reason"] == "request failed: ConnectError"
        assert row["marked_down"] == 1 and row["in_flight"] == 0

        odd = odd_slot.restart(ODD)  # the same ports, an empty cache
        wait_for(lambda: service.replicas()[ODD]["up"], f"{ODD} up again", 120)
        # up again: the index holds nothing of it before any request reaches it
        assert service.lookup(prompt)[ODD] == 0
        probe = wait_for(
            lambda: (p := service.replicas()[ODD]["probe"])["at"] > first["at"] and p,
            "the attach probe to run again",
        )
        assert probe["ok"], probe
        assert f"replica {ODD} restarted" in service.log()


def test_streams_closed_right_after_done_all_report_their_cached_tokens(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    streams = 40
    system = random_tokens(4 * BLOCK)
    with serving(tmp_path, list(fleet), vllm_install.model) as service:
        service.wait_probed([s.name for s in fleet])
        figures = []
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            for _ in range(streams):
                body = {
                    "model": MODEL,
                    "prompt": system + random_tokens(7),
                    "max_tokens": 3,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                with client.stream("POST", f"{service.url}/v1/completions", json=body) as answer:
                    assert answer.status_code == 200
                    for line in answer.iter_lines():
                        if '"usage"' in line:
                            figures.append(line)
                        if line == "data: [DONE]":
                            break  # and close at once, as the openai SDK does
        assert len(figures) == streams

        def settled() -> dict[str, Any] | None:
            stats = service.get("/v1/stats")
            rows = stats["attribution"]
            return stats if rows and sum(r["requests"] for r in rows) == streams else None

        stats = wait_for(settled, "every stream's figure")
        assert stats["unreported_requests"] == 0
        (row,) = stats["attribution"]
        assert row["delivered_tokens"] >= (streams - 2) * 4 * BLOCK  # the system prompt, hit


def test_engine_hash_vllm_is_the_engines_default_and_the_salted_probe_agrees(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    servers = list(fleet)  # started with vLLM's default --prefix-caching-hash-algo
    overrides = {s.name: {"engine_hash": "vllm"} for s in servers}
    with serving(
        tmp_path, servers, vllm_install.model, keys=True, replica_overrides=overrides
    ) as service:
        rows = service.wait_probed([s.name for s in servers])
        for server in servers:
            found = _findings(rows[server.name])
            assert rows[server.name]["probe"]["ok"], found
            assert found["engine hash"]["detail"] == "the events' hashes are vllm-sha256's"
            assert found["cache salt"]["ok"], found["cache salt"]
        answer = httpx.get(
            f"{service.url}/v1/replicas", headers=bearer(OPERATOR), timeout=HTTP_TIMEOUT_S
        )
        assert not any(r["degraded"] for r in answer.json()["replicas"])
