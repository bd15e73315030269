"""Route-API mode: the gateway reports what the engine delivered on release, the service checks
it against the route's prediction, degrades a replica whose engine delivers less, and sums the
attribution per tenant (a tenant key sees its own rows). Bad reports change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import ConfigError
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import parse_config

MODEL = "m"
BLOCK = 4
ACME = "sk-acme-0123456789abcdef0000"
OPS = "sk-operator-0123456789abcdef"
PROMPT = list(range(1, 42))  # 41 tokens: 10 full blocks


def _client(tmp_path: Path) -> TestClient:
    (tmp_path / "keys.yaml").write_text(f"{ACME}: acme\n{OPS}: {{role: operator, name: ops}}\n")
    config = parse_config(
        {
            "auth": {"keys_file": "keys.yaml"},
            "delivery": {"window": 10, "min_requests": 6},
            "routing": {"policy": "prefix"},
            "replicas": [
                {"name": "a", "model": MODEL, "block_size": BLOCK},
                {"name": "b", "model": MODEL, "block_size": BLOCK},
            ],
        },
        "fleet.yaml",
        tmp_path,
    )
    index = MemoryFleetIndex()
    salted = Namespace(MODEL, salt="tenant:acme")  # the tenant's blocks, as its engine keys them
    index.store("a", BlockHasher(BLOCK).hash_prompt(PROMPT, salted))
    index.store("b", BlockHasher(BLOCK).hash_prompt(PROMPT[:16], salted))
    return TestClient(build_service(config, index=index, ingest=None))


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_reports_on_release_degrade_a_replica_that_delivers_less(tmp_path: Path) -> None:
    with _client(tmp_path) as client:
        for i in range(6):
            route = client.post(
                "/v1/route",
                json={"model": MODEL, "tokens": PROMPT, "request_id": f"r{i}"},
                headers=_auth(ACME),
            ).json()
            assert route["replica"] == "a" and route["cached_tokens"] == 40
            released = client.post(
                "/v1/release", json={"request_id": f"r{i}", "cached_tokens": 0}, headers=_auth(ACME)
            )
            assert released.status_code == 200, released.text
        rows = {
            r["name"]: r for r in client.get("/v1/replicas", headers=_auth(OPS)).json()["replicas"]
        }
        assert (
            rows["a"]["degraded"] and "predicted 40 cached tokens" in rows["a"]["degraded_reason"]
        )
        assert not rows["b"]["degraded"] and rows["b"]["delivery"]["requests"] == 0
        mine = client.get("/v1/stats", headers=_auth(ACME)).json()
        assert mine == {
            "attribution": [
                {
                    "tenant": "acme",
                    "model": MODEL,
                    "requests": 6,
                    "prompt_tokens": 246,
                    "available_tokens": 240,
                    "captured_tokens": 240,
                    "delivered_tokens": 0,
                }
            ]
        }
        ops = client.get("/v1/stats", headers=_auth(OPS)).json()
        assert ops["degraded"].keys() == {"a"} and ops["unreported_requests"] == 0
        # released without a figure: not summed, not judged
        client.post(
            "/v1/route",
            json={"model": MODEL, "tokens": PROMPT, "request_id": "x"},
            headers=_auth(ACME),
        )
        client.post("/v1/release", json={"request_id": "x"}, headers=_auth(ACME))
        assert (
            client.get("/v1/stats", headers=_auth(ACME)).json()["attribution"][0]["requests"] == 6
        )


@pytest.mark.parametrize("figure", [-1, 1.5, "3", True])
def test_a_bad_report_is_refused_and_changes_nothing(tmp_path: Path, figure: object) -> None:
    with _client(tmp_path) as client:
        client.post(
            "/v1/route",
            json={"model": MODEL, "tokens": PROMPT, "request_id": "r"},
            headers=_auth(ACME),
        )
        bad = client.post(
            "/v1/release", json={"request_id": "r", "cached_tokens": figure}, headers=_auth(ACME)
        )
        assert bad.status_code == 422 and "cached_tokens" in bad.json()["error"]["message"]
        assert (
            client.post(
                "/v1/release", json={"request_id": "r", "cached_tokens": 40}, headers=_auth(ACME)
            ).status_code
            == 200
        )
        assert (
            client.get("/v1/stats", headers=_auth(ACME)).json()["attribution"][0][
                "delivered_tokens"
            ]
            == 40
        )


def test_delivery_settings_are_checked(tmp_path: Path) -> None:
    base = {"replicas": [{"name": "a", "model": MODEL, "block_size": BLOCK}]}
    for delivery, where in (
        ({"window": 0}, "delivery.window"),
        ({"window": 10, "min_requests": 11}, "delivery.min_requests"),
        ({"tolerance": 1.5}, "delivery.tolerance"),
        ({"tolerance": 0}, "delivery.tolerance"),
        ({"windw": 3}, "windw"),
    ):
        with pytest.raises(ConfigError, match=where):
            parse_config({**base, "delivery": delivery}, "fleet.yaml", tmp_path)
