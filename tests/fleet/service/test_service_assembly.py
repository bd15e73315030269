"""The service's one composition root: ``build_service`` builds every part from the config alone
(index, router, KV-event subscriber, route observers), the route observers see each route and are
closed with the app, and ``prefixcache serve``'s options reach the config it is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from prefixcache.errors import ConfigError
from prefixcache.fleet.events.subscriber import KVEventSubscriber
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.fleet.service.startup import ServeOptions, open_service, serve_config
from tests.fleet_support import free_port

MODEL = "m"
BLOCK = 4


def _config(tmp_path: Path, **sections: Any) -> Any:
    replicas = [
        {"name": "a", "model": MODEL, "block_size": BLOCK, "events": f"tcp://127.0.0.1:{free_port()}"},
        {"name": "b", "model": MODEL, "block_size": BLOCK},
    ]  # fmt: skip
    data = {"routing": {"policy": "round_robin"}, "replicas": replicas, **sections}
    return parse_config(data, "fleet.yaml", tmp_path)


def test_one_call_builds_every_part_from_the_config(tmp_path: Path) -> None:
    config = _config(tmp_path, whatif={"rate": 1.0}, record_trace={"path": "routed.jsonl"})
    app = build_service(config)
    service = app.state.service
    assert isinstance(service.router.index, MemoryFleetIndex)  # the config's "memory"
    assert service.router.policy == "round_robin"
    assert isinstance(service.ingest, KVEventSubscriber)  # follows replica a's events
    assert service.observers.watching
    with TestClient(app) as client:
        for i in range(3):
            body = {"model": MODEL, "tokens": list(range(i, i + 3 * BLOCK))}
            assert client.post("/v1/route", json=body).status_code == 200
        curves = client.get("/v1/whatif").json()
        health = client.get("/healthz").json()
    assert curves["window"]["routed_requests"] == 3
    assert curves["counterfactuals"]["state"] == "idle"
    assert health["ingest"] is True
    # the recorder saw each route and was closed (flushed) when the app stopped
    lines = (tmp_path / "routed.jsonl").read_text().splitlines()
    assert [len(json.loads(line)["hash_ids"]) for line in lines] == [3, 3, 3]


def test_nothing_watches_routes_when_curves_and_recording_are_off(tmp_path: Path) -> None:
    config = _config(tmp_path, whatif={"enabled": False})
    service = build_service(config, index=MemoryFleetIndex(), ingest=None).state.service
    assert not service.observers.watching
    assert service.router._observer is None  # the route path calls no observer at all
    assert service.ingest is None


def test_serve_options_reach_the_config(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    replicas = [{"name": "a", "model": MODEL, "url": "http://127.0.0.1:9"}]
    path.write_text(yaml.safe_dump({"replicas": replicas}))
    plain = serve_config(ServeOptions(str(path)))
    assert (plain.index, plain.proxy.enabled, plain.record_trace.path) == ("memory", False, None)
    trace = str(tmp_path / "t.jsonl")
    options = ServeOptions(str(path), "memory+compact", True, trace)
    config = serve_config(options)
    assert (config.index, config.proxy.enabled, config.record_trace.path) == (
        "memory+compact",
        True,
        trace,
    )
    app, opened = open_service(ServeOptions(str(path), "memory+compact", True))
    assert (opened.index, opened.proxy.enabled) == ("memory+compact", True)
    assert app.state.service.proxying  # the proxy's endpoints are there
    assert "/v1/completions" in {getattr(r, "path", "") for r in app.router.routes}


def test_proxy_mode_without_a_replica_url_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "a", "model": MODEL}]}))
    with pytest.raises(ConfigError, match=r"proxy mode needs a url for every replica.*'a'"):
        open_service(ServeOptions(str(path), proxy=True))
