"""The service's OpenAI-compatible listing and vLLM-style health check over real HTTP (uvicorn in
a subprocess): ``GET /v1/models`` lists what the replicas serve, ``GET /health`` answers 200, in
route-API mode and in proxy mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fleet.fleet_processes import running
from tests.fleet_support import free_port

REPLICAS = """
replicas:
  - {name: a, model: llama, block_size: 4, url: "http://127.0.0.1:9/a", adapters: [sql, "*"]}
  - {name: b, model: llama, block_size: 4, url: "http://127.0.0.1:9/b"}
  - {name: c, model: qwen, adapter: chat-lora, block_size: 4, url: "http://127.0.0.1:9/c"}
"""


@pytest.fixture(params=[False, True], ids=["route-api", "proxy"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[httpx.Client]:
    proxy = "true" if request.param else "false"
    config = f"index: memory\nproxy: {{enabled: {proxy}}}\n" + REPLICAS
    (tmp_path / "fleet.yaml").write_text(config)
    port = free_port()
    args = [
        "tests.fleet.service.fleet_launcher",
        "--config",
        str(tmp_path / "fleet.yaml"),
        "--port",
        str(port),
    ]
    with (
        running(args, port, tmp_path / "service.log") as base,
        httpx.Client(base_url=base, timeout=10.0) as client,
    ):
        yield client


def test_models_lists_what_the_replicas_serve_in_openais_format(service: httpx.Client) -> None:
    answer = service.get("/v1/models")
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["llama", "sql", "chat-lora"]
    for model in body["data"]:
        assert model["object"] == "model" and model["owned_by"] == "prefixcache"
        assert isinstance(model["created"], int) and model["created"] > 0


def test_health_answers_200_as_vllms(service: httpx.Client) -> None:
    answer = service.get("/health")
    assert answer.status_code == 200 and answer.content == b""


def test_route_api_mode_probes_replicas_and_stops_choosing_a_dead_one(tmp_path: Path) -> None:
    from tests.fleet_support import wait_until

    up_port, port, dead_port = free_port(), free_port(), free_port()
    (tmp_path / "fleet.yaml").write_text(
        f"""
index: memory
routing: {{policy: round_robin}}
health: {{probe_interval_s: 0.2, probe_timeout_s: 0.5, down_s: 60}}
replicas:
  - {{name: live, model: m, block_size: 4, url: "http://127.0.0.1:{up_port}/live"}}
  - {{name: dead, model: m, block_size: 4, url: "http://127.0.0.1:{dead_port}"}}
"""
    )
    args = [
        "tests.fleet.service.fleet_launcher",
        "--config",
        str(tmp_path / "fleet.yaml"),
        "--port",
        str(port),
    ]
    upstream = ["tests.fleet.service.fake_openai_upstream", "--port", str(up_port)]
    with (
        running(upstream, up_port, tmp_path / "upstream.log"),
        running(args, port, tmp_path / "service.log") as base,
        httpx.Client(base_url=base, timeout=10.0) as client,
    ):

        def up() -> dict[str, bool]:
            rows = client.get("/v1/replicas").json()["replicas"]
            return {r["name"]: r["up"] for r in rows}

        wait_until(lambda: up() == {"live": True, "dead": False}, what="the dead replica down")
        chosen = {
            client.post("/v1/route", json={"model": "m", "tokens": [1, 2, 3, 4]}).json()["replica"]
            for _ in range(6)
        }
        assert chosen == {"live"}
