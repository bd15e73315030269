"""A bounded fuzzer over every endpoint of the service: bodies of every JSON shape (wrong types,
unknown fields, nesting about 1,000 deep, numbers of 5,000 digits, bytes that are no JSON), with
and without keys. No answer is a 5xx, every 4xx is a JSON error, and a refused request changes
nothing: the index, the requests in flight and every metric but the error counters are as before.

In process through the whole ASGI app for speed, plus the sharpest bodies over a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fleet.service.serve_harness import (
    ALICE,
    MALLORY,
    MODEL,
    OPERATOR,
    Replicas,
    bearer,
    engine_stores,
    make_app,
    make_config,
    serving,
)

POSTS = ("/v1/lookup", "/v1/route", "/v1/release", "/v1/completions", "/v1/chat/completions")
GETS = ("/v1/replicas", "/v1/models", "/healthz", "/health", "/metrics")
FIELDS = (
    "model", "tokens", "text", "messages", "adapter", "adapter_version", "salt", "extra",
    "request_id", "prompt", "cache_salt", "add_generation_prompt", "continue_final_message",
    "tools", "documents", "chat_template_kwargs", "stream", "max_tokens",
)  # fmt: skip
ERROR_COUNTERS = ("prefixcache_http_errors", "prefixcache_rejected_requests")
KEYS = (None, ALICE, MALLORY, OPERATOR, "sk-wrong-key-0000000000000")

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from([MODEL, "x", ""])
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=20,
)
shaped = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6)


def _huge(digits: int) -> st.SearchStrategy[str]:
    return st.sampled_from(
        ["9" * digits, "-" + "9" * digits, "1e" + "9" * digits, "0." + "1" * digits]
    )


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["shaped", "any", "deep", "huge", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "any":
        return json.dumps(draw(json_values)).encode()
    base = draw(shaped)
    if kind == "shaped":
        return json.dumps(base).encode()
    field = draw(st.sampled_from(FIELDS))
    if kind == "huge":  # a number of thousands of digits where any value may go
        number = draw(_huge(draw(st.integers(4000, 5000))))
        inner = draw(st.sampled_from([number, f"[{number}]", f"[1, 2, {number}]"]))
    else:  # nesting about 1,000 levels deep, of lists or of objects
        depth = draw(st.integers(900, 1100))
        opening, closing = draw(st.sampled_from([("[", "]"), ('{"a": ', "}")]))
        inner = opening * depth + json.dumps(draw(leaves)) + closing * depth
    rest = json.dumps({k: v for k, v in base.items() if k != field})
    return (rest[:-1] + (", " if len(rest) > 2 else "") + f'"{field}": {inner}}}').encode()


requests = st.tuples(
    st.sampled_from([("POST", p) for p in POSTS] + [("GET", p) for p in GETS]),
    bodies(),
    st.sampled_from(KEYS),
)


def _state(app: Any) -> tuple[Any, ...]:
    service = app.state.service
    router = service.router
    names = [spec.name for spec in router.replicas()]
    metrics = [
        line
        for line in service.metrics.render().decode().splitlines()
        if not line.startswith(ERROR_COUNTERS) and not line.startswith("#")
    ]
    in_flight = sorted(router.in_flight_among(_IDS))
    return router.index.num_blocks_many(names), router.loads(), in_flight, metrics


_IDS = ("held", "job-1")


def _fuzz(tmp_path: Path, keys: bool) -> None:
    config = make_config(tmp_path, keys=keys, proxy=True)
    app, index = make_app(config)
    engine_stores(index, "r1", list(range(1, 17)), None)
    engine_stores(index, "r2", list(range(1, 9)), "tenant:alice")
    replicas = Replicas()
    with TestClient(app) as client:
        app.state.service.http_client = replicas.client()
        held = {"model": MODEL, "tokens": [1, 2, 3, 4], "request_id": "held"}
        assert client.post("/v1/route", json=held, headers=bearer(ALICE)).status_code == 200
        before = [_state(app)]

        @settings(
            max_examples=120,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests)
        def probe(request: tuple[tuple[str, str], bytes, str | None]) -> None:
            (method, path), body, key = request
            headers = {"content-type": "application/json"}
            if key is not None:
                headers.update(bearer(key))
            answer = client.request(method, path, content=body, headers=headers)
            assert answer.status_code < 500, (path, body[:200], answer.text)
            if answer.status_code >= 400:
                error = answer.json()["error"]
                assert isinstance(error["type"], str) and isinstance(error["message"], str)
                assert _state(app) == before[0], (path, body[:200], answer.text)
            else:
                router = app.state.service.router
                for rid in router.in_flight_among(_IDS) - {"held"}:  # a fuzzed route with an id
                    router.release(rid)
                before[0] = _state(app)

        probe()
        assert app.state.service.router.in_flight() <= 2


def test_fuzzed_bodies_with_keys_never_5xx_and_change_nothing(tmp_path: Path) -> None:
    _fuzz(tmp_path, keys=True)


def test_fuzzed_bodies_without_keys_never_5xx_and_change_nothing(tmp_path: Path) -> None:
    _fuzz(tmp_path, keys=False)


def test_the_sharpest_bodies_over_a_real_server(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    app, _ = make_app(config)
    deep_list = "[" * 1000 + "1" + "]" * 1000
    deep_object = '{"a": ' * 1000 + "1" + "}" * 1000
    cases = [
        '{"model": "m", "tokens": ' + deep_list + "}",
        '{"model": "m", "tokens": [1, 2], "extra": ' + deep_object + "}",
        '{"model": "m", "tokens": [' + "9" * 5000 + "]}",
        '{"model": ' + "1" * 5000 + "}",
        '{"request_id": ' + deep_list + "}",
        '{"model": "m", "tokens": "1234"}',
        '{"model": "m", "tokens": [1], "surprise": true}',
    ]
    with serving(app, config) as base, httpx.Client(base_url=base) as client:
        for body in cases:
            for path in ("/v1/lookup", "/v1/route", "/v1/release"):
                for key in (ALICE, None):
                    headers = {"content-type": "application/json"}
                    if key is not None:
                        headers.update(bearer(key))
                    answer = client.post(path, content=body, headers=headers)
                    assert 400 <= answer.status_code < 500, (path, body[:80], answer.text)
                    assert answer.json()["error"]["message"]
        assert app.state.service.router.in_flight() == 0
