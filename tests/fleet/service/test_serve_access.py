"""API keys, tenants and per-key limits of the service (in process, through the whole ASGI app):
who gets in, what a key can see, whose request ids a key can touch, and the 429s of the limits."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.errors import ConfigError
from prefixcache.fleet.service.transport import exposure_warning
from tests.fleet.service.serve_harness import (
    ALICE,
    ALICE2,
    MALLORY,
    MODEL,
    OPERATOR,
    Replicas,
    bearer,
    engine_stores,
    make_app,
    make_config,
)
from tests.fleet_support import wait_until

SECRET_PROMPT = [7, 3, 1, 9, 4, 4, 2, 8, 5, 0, 6, 1, 2, 3, 4, 5]  # the PIN is in tokens 4..11


def _rejected(client: TestClient) -> dict[tuple[str, str], float]:
    text = client.get("/metrics", headers=bearer(OPERATOR)).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "prefixcache_rejected_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["reason"], s.labels["key"])] = s.value
    return out


@pytest.fixture
def secured(tmp_path: Path) -> Any:
    config = make_config(tmp_path, extra={"auth": {"max_in_flight_per_key": 2}})
    app, index = make_app(config)
    with TestClient(app) as client:
        yield client, index


def test_requests_without_a_valid_key_get_401_with_a_bearer_challenge(secured: Any) -> None:
    client, _ = secured
    body = {"model": MODEL, "tokens": [1, 2, 3, 4]}
    for headers in (
        {},
        bearer("sk-not-a-key-at-all-000000"),
        {"authorization": f"Basic {ALICE}"},
        {"authorization": "Bearer"},
        {"authorization": f"Bearer {ALICE}x"},
    ):
        for method, path in (("POST", "/v1/lookup"), ("POST", "/v1/route"), ("GET", "/metrics")):
            answer = client.request(method, path, json=body, headers=headers)
            assert answer.status_code == 401, (headers, path)
            assert answer.headers["www-authenticate"] == "Bearer"
            assert answer.json()["error"]["type"] == "Unauthorized"
    assert client.post("/v1/lookup", json=body, headers=bearer(ALICE)).status_code == 200
    assert client.get("/healthz").status_code == 200  # open
    assert client.get("/health").status_code == 200
    assert _rejected(client)[("unauthenticated", "-")] == 15


def test_metrics_and_replicas_need_an_operator_key(secured: Any) -> None:
    client, _ = secured
    for path in ("/metrics", "/v1/replicas"):
        answer = client.get(path, headers=bearer(ALICE))
        assert answer.status_code == 403
        assert answer.json()["error"]["type"] == "Forbidden"
        assert client.get(path, headers=bearer(OPERATOR)).status_code == 200
    assert client.get("/v1/models", headers=bearer(ALICE)).status_code == 200
    assert _rejected(client)[("forbidden", "alice-" + _label_suffix(ALICE))] == 2


def _label_suffix(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:8]


def test_a_pin_probe_from_another_tenant_learns_nothing(secured: Any) -> None:
    """The victim's prompt holds a secret; the attacker knows its start and probes every next
    token over /v1/lookup and /v1/route, with every salt it may guess: every probe reads 0
    cached tokens, while the victim's own key sees its hits."""
    client, index = secured
    # the victim routes its prompt and sends it to the engine with the cache_salt it is told
    routed = client.post(
        "/v1/route", json={"model": MODEL, "tokens": SECRET_PROMPT}, headers=bearer(ALICE)
    ).json()
    salt = routed["cache_salt"]
    assert salt is not None and routed["cached_tokens"] == 0
    engine_stores(index, routed["replica"], SECRET_PROMPT, salt)
    mine = client.post(
        "/v1/lookup", json={"model": MODEL, "tokens": SECRET_PROMPT}, headers=bearer(ALICE2)
    ).json()  # the victim tenant's other key sees the hit too
    assert max(r["cached_tokens"] for r in mine["replicas"]) == len(SECRET_PROMPT)
    guesses: list[str | None] = [None, salt, "alice", "tenant:alice", ""]
    for length in range(BLOCK_START, len(SECRET_PROMPT) + 1):
        for candidate in range(10):  # the next digit of the PIN
            tokens = SECRET_PROMPT[: length - 1] + [candidate]
            for guess in guesses:
                body: dict[str, Any] = {"model": MODEL, "tokens": tokens, "salt": guess}
                looked = client.post("/v1/lookup", json=body, headers=bearer(MALLORY))
                assert looked.status_code == 200
                assert all(r["cached_tokens"] == 0 for r in looked.json()["replicas"])
                routed_probe = client.post("/v1/route", json=body, headers=bearer(MALLORY))
                assert routed_probe.status_code == 200
                assert routed_probe.json()["cached_tokens"] == 0
                assert routed_probe.json()["cache_salt"] != salt


BLOCK_START = 4  # the first probe covers one whole block


def test_an_operator_without_a_tenant_sees_the_unscoped_namespaces(secured: Any) -> None:
    client, index = secured
    engine_stores(index, "r1", SECRET_PROMPT, None)
    body = {"model": MODEL, "tokens": SECRET_PROMPT}
    ops = client.post("/v1/lookup", json=body, headers=bearer(OPERATOR)).json()
    assert max(r["cached_tokens"] for r in ops["replicas"]) == len(SECRET_PROMPT)
    alice = client.post("/v1/lookup", json=body, headers=bearer(ALICE)).json()
    assert max(r["cached_tokens"] for r in alice["replicas"]) == 0


def test_request_ids_belong_to_the_key_that_routed_them(secured: Any) -> None:
    client, _ = secured
    body = {"model": MODEL, "tokens": [1, 2, 3, 4], "request_id": "job-1"}
    first = client.post("/v1/route", json=body, headers=bearer(ALICE))
    assert first.status_code == 200 and first.json()["request_id"] == "job-1"
    # another key can neither release it nor collide with it
    foreign = client.post("/v1/release", json={"request_id": "job-1"}, headers=bearer(MALLORY))
    assert foreign.status_code == 404
    assert "'job-1'" in foreign.json()["error"]["message"]
    assert client.post("/v1/route", json=body, headers=bearer(MALLORY)).status_code == 200
    # the same tenant's other key is another key: its ids are its own too
    assert (
        client.post("/v1/release", json={"request_id": "job-1"}, headers=bearer(ALICE2)).status_code
        == 404
    )
    again = client.post("/v1/route", json=body, headers=bearer(ALICE))
    assert again.status_code == 409
    assert again.json()["error"]["message"] == "request 'job-1' is already in flight"
    released = client.post("/v1/release", json={"request_id": "job-1"}, headers=bearer(ALICE))
    assert released.status_code == 200 and released.json()["request_id"] == "job-1"
    assert (
        client.post("/v1/release", json={"request_id": "job-1"}, headers=bearer(ALICE)).status_code
        == 404
    )
    assert (
        client.post(
            "/v1/release", json={"request_id": "job-1"}, headers=bearer(MALLORY)
        ).status_code
        == 200
    )
    assert client.app.state.service.router.in_flight() == 0


def test_a_key_over_its_in_flight_cap_gets_429_until_it_releases(secured: Any) -> None:
    client, _ = secured

    def route(key: str, rid: str) -> Any:
        body = {"model": MODEL, "tokens": [1, 2, 3, 4], "request_id": rid}
        return client.post("/v1/route", json=body, headers=bearer(key))

    assert route(ALICE, "a").status_code == 200
    assert route(ALICE, "b").status_code == 200
    over = route(ALICE, "c")
    assert over.status_code == 429
    assert over.headers["retry-after"] == "1"
    assert over.json()["error"]["type"] == "TooManyRequestsError"
    assert route(MALLORY, "c").status_code == 200  # another key has its own cap
    assert route(ALICE, "b").status_code == 429  # a duplicate is refused by the cap first
    client.post("/v1/release", json={"request_id": "a"}, headers=bearer(ALICE))
    assert route(ALICE, "c").status_code == 200
    assert client.app.state.service.router.in_flight() == 3
    assert _rejected(client)[("in_flight_limit", "alice-" + _label_suffix(ALICE))] == 2


def test_a_key_over_its_rate_gets_429_with_retry_after(tmp_path: Path) -> None:
    config = make_config(tmp_path, extra={"auth": {"rate_per_s": 0.001, "burst": 3}})
    app, _ = make_app(config)
    body = {"model": MODEL, "tokens": [1, 2, 3, 4]}
    with TestClient(app) as client:
        for path in ("/v1/lookup", "/v1/route", "/v1/lookup"):
            assert client.post(path, json=body, headers=bearer(ALICE)).status_code == 200
        for path in ("/v1/lookup", "/v1/route"):
            limited = client.post(path, json=body, headers=bearer(ALICE))
            assert limited.status_code == 429
            assert int(limited.headers["retry-after"]) >= math.floor(0.9 / 0.001)
            assert "rate limit" in limited.json()["error"]["message"]
        assert client.post("/v1/lookup", json=body, headers=bearer(MALLORY)).status_code == 200
        assert _rejected(client)[("rate_limited", "alice-" + _label_suffix(ALICE))] == 2


def test_the_proxy_forwards_the_tenant_salt_and_not_the_callers_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "engine-key")
    config = make_config(tmp_path, proxy=True, extra={"auth": {"upstream_key_env": "UPSTREAM_KEY"}})
    app, index = make_app(config)
    replicas = Replicas()
    with TestClient(app) as client:
        app.state.service.http_client = replicas.client()
        payload = {"model": MODEL, "prompt": SECRET_PROMPT, "cache_salt": "mine", "max_tokens": 1}
        answer = client.post("/v1/completions", json=payload, headers=bearer(ALICE))
        assert answer.status_code == 200
        forwarded, headers = replicas.seen[-1]
        assert forwarded["cache_salt"] == "tenant:alice:mine"
        assert forwarded["prompt"] == SECRET_PROMPT and forwarded["max_tokens"] == 1
        assert headers["authorization"] == "Bearer engine-key"
        # the engine cached it under that salt: alice's route finds it, mallory's does not
        engine_stores(
            index, answer.headers["x-prefixcache-replica"], SECRET_PROMPT, "tenant:alice:mine"
        )
        route = {"model": MODEL, "tokens": SECRET_PROMPT, "salt": "mine"}
        mine = client.post("/v1/route", json=route, headers=bearer(ALICE)).json()
        assert mine["cached_tokens"] == len(SECRET_PROMPT)
        assert mine["cache_salt"] == "tenant:alice:mine"
        for salt in ("mine", "tenant:alice:mine", None):
            theirs = client.post(
                "/v1/completions", json={**payload, "cache_salt": salt}, headers=bearer(MALLORY)
            )
            assert theirs.status_code == 200
            assert replicas.seen[-1][0]["cache_salt"].startswith("tenant:mallory")
        assert app.state.service.router.in_flight() == 0  # every proxied request was released


def test_without_keys_the_service_is_open_and_unscoped(tmp_path: Path) -> None:
    app, _ = make_app(make_config(tmp_path, keys=False, proxy=True))
    replicas = Replicas()
    with TestClient(app) as client:
        app.state.service.http_client = replicas.client()
        body = {"model": MODEL, "tokens": [1, 2, 3, 4], "salt": "s", "request_id": "x"}
        routed = client.post("/v1/route", json=body)
        assert routed.status_code == 200 and routed.json()["cache_salt"] == "s"
        assert client.post("/v1/release", json={"request_id": "x"}).status_code == 200
        assert client.get("/metrics").status_code == 200
        payload = {"model": MODEL, "prompt": "hi", "cache_salt": "s"}
        client.post("/v1/completions", json=payload, headers={"authorization": "Bearer abc"})
        forwarded, headers = replicas.seen[-1]
        assert forwarded["cache_salt"] == "s" and headers["authorization"] == "Bearer abc"


def test_listening_beyond_loopback_without_keys_is_warned_about(tmp_path: Path) -> None:
    open_config = make_config(tmp_path, keys=False)
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.com"):
        warning = exposure_warning(host, open_config)
        assert warning is not None and "without API keys" in warning
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, open_config) is None
    assert exposure_warning("0.0.0.0", make_config(tmp_path)) is None


@pytest.mark.parametrize(
    ("auth", "keys", "message"),
    [
        ({"keys_file": "keys.yaml", "bogus": 1}, None, "auth: unknown key 'bogus'"),
        ({"keys_file": "missing.yaml"}, None, "auth.keys_file: cannot read"),
        ({"keys_file": "keys.yaml"}, "short: alice\n", "auth.keys_file: entry 1: a key must be"),
        ({"keys_file": "keys.yaml"}, f"{ALICE}: {{role: admin, tenant: a}}\n", "entry 1.role"),
        ({"keys_file": "keys.yaml"}, f"{ALICE}: {{role: tenant}}\n", "needs a 'tenant'"),
        ({"keys_file": "keys.yaml"}, f"{ALICE}: 'a:b'\n", "entry 1.tenant"),
        ({"keys_file": "keys.yaml"}, f"{ALICE}: {{tenant: a, x: 1}}\n", "unknown key 'x'"),
        ({"keys_file": "keys.yaml"}, "[1, 2]\n", "expected a non-empty mapping"),
        (
            {"keys_file": "keys.yaml"},
            f"{ALICE}: {{tenant: a, name: n}}\n{MALLORY}: {{tenant: b, name: n}}\n",
            "two keys are named 'n'",
        ),
        ({"keys_env": "NO_SUCH_VARIABLE_HERE"}, None, "auth.keys_env: environment variable"),
        ({"max_in_flight_per_key": 0}, None, "auth.max_in_flight_per_key: expected an integer"),
        ({"rate_per_s": -1}, None, "auth.rate_per_s: expected a positive"),
        ({"burst": 5}, None, "auth.burst: a burst needs a rate_per_s"),
    ],
)
def test_auth_config_errors_say_where(
    tmp_path: Path, auth: dict[str, Any], keys: str | None, message: str
) -> None:
    from prefixcache.fleet.service.configuration.config_file import parse_config

    if keys is not None:
        (tmp_path / "keys.yaml").write_text(keys)
    data = {"replicas": [{"name": "r", "model": MODEL}], "auth": auth}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "fleet.yaml", tmp_path)
    assert message in str(caught.value)
    assert ALICE not in str(caught.value)  # a key never shows in an error


def test_keys_from_an_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_KEYS", f"{{{ALICE}: alice, {OPERATOR}: {{role: operator}}}}")
    config = make_config(tmp_path, keys=False, extra={"auth": {"keys_env": "FLEET_KEYS"}})
    assert config.access.enabled and len(config.access.keys) == 2
    assert all(ALICE not in repr(key) for key in config.access.keys)  # only digests are kept
    app, _ = make_app(config)
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=bearer(ALICE)).status_code == 200
        assert client.get("/metrics", headers=bearer(OPERATOR)).status_code == 200


def test_ids_whose_load_expired_no_longer_count_against_the_cap(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        extra={"auth": {"max_in_flight_per_key": 1}, "routing": {"in_flight_timeout_s": 0.2}},
    )
    app, _ = make_app(config)
    body = {"model": MODEL, "tokens": [1, 2, 3, 4], "request_id": "never-released"}
    with TestClient(app) as client:
        assert client.post("/v1/route", json=body, headers=bearer(ALICE)).status_code == 200
        router = app.state.service.router
        wait_until(lambda: router.in_flight() == 0, "the route's load to expire")
        again = {**body, "request_id": "next"}
        assert client.post("/v1/route", json=again, headers=bearer(ALICE)).status_code == 200
        assert client.post("/v1/route", json=body, headers=bearer(ALICE)).status_code == 429
