"""The fleet service over real HTTP: the app in a uvicorn subprocess on 127.0.0.1, seeded with the
test index, and a fake OpenAI-compatible upstream in another subprocess for proxy mode."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet.fleet_processes import ROOT, running
from tests.fleet_support import free_port, wait_until

PROMPT = list(range(1, 33))  # 8 blocks of 4 tokens
TEXT = "hello fleet, this prompt is shared"
MAX_BODY = 16384
MAX_TOKENS = 256


# ChatML, the template of Qwen and others; the replica-b seed holds a conversation rendered by it
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = {"role": "system", "content": "You answer questions about the fleet, briefly."}
FIRST = {"role": "user", "content": "Which replica holds this conversation?"}
SEEN = (  # the first turn as the engine rendered it
    f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n"
    f"<|im_start|>user\n{FIRST['content']}<|im_end|>\n<|im_start|>assistant\n"
)


def _config(upstream: str, dead_port: int) -> str:
    return f"""
index: memory
chat_template: chatml.jinja
routing: {{policy: prefix}}
proxy: {{enabled: true, timeout_s: 30}}
health: {{probe_interval_s: null, down_s: 60}}
limits: {{max_body_bytes: {MAX_BODY}, max_prompt_tokens: {MAX_TOKENS}, max_replicas: 8}}
replicas:
  - {{name: replica-a, model: m, block_size: 4, capacity_blocks: 1000, url: "{upstream}/replica-a",
      events: "tcp://127.0.0.1:5557"}}
  - {{name: replica-b, model: m, block_size: 4, capacity_blocks: 1000, url: "{upstream}/replica-b"}}
  - {{name: replica-dead, model: dead, block_size: 4, url: "http://127.0.0.1:{dead_port}"}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fleet")
    up_port, port, dead_port = free_port(), free_port(), free_port()
    upstream_base = f"http://127.0.0.1:{up_port}"
    (tmp / "fleet.yaml").write_text(_config(upstream_base, dead_port))
    (tmp / "chatml.jinja").write_text(CHATML)
    seed = [
        {"replica": "replica-a", "tokens": PROMPT},
        {"replica": "replica-b", "tokens": PROMPT[:8]},
        {"replica": "replica-b", "text": TEXT},
        {"replica": "replica-b", "text": SEEN},
    ]
    (tmp / "seed.json").write_text(json.dumps(seed))
    markers = tmp / "markers"
    markers.mkdir()
    service_args = [
        "tests.fleet.service.fleet_launcher",
        "--config", str(tmp / "fleet.yaml"),
        "--port", str(port),
        "--seed", str(tmp / "seed.json"),
        "--markers", str(markers),
    ]  # fmt: skip
    upstream_args = ["tests.fleet.service.fake_openai_upstream", "--port", str(up_port)]
    with (
        running(upstream_args, up_port, tmp / "upstream.log"),
        running(service_args, port, tmp / "service.log") as base,
        httpx.Client(base_url=base, timeout=10.0) as client,
    ):
        yield {"client": client, "markers": markers}


def _state(client: httpx.Client) -> tuple[Any, Any]:
    """Loads and index sizes of every replica, and the lookups of the seeded prompts."""
    replicas = client.get("/v1/replicas").json()
    for replica in replicas["replicas"]:
        del replica["down_for_s"]  # counts down by itself
    lookups = [
        client.post("/v1/lookup", json={"model": "m", "tokens": PROMPT}).json(),
        client.post("/v1/lookup", json={"model": "m", "text": TEXT}).json(),
    ]
    return replicas, lookups


def _cached(lookup: dict[str, Any]) -> dict[str, int]:
    return {r["name"]: r["cached_tokens"] for r in lookup["replicas"]}


def test_health_and_replicas(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["replicas"] == 3 and health["proxy"] is True
    replicas = {r["name"]: r for r in client.get("/v1/replicas").json()["replicas"]}
    assert set(replicas) == {"replica-a", "replica-b", "replica-dead"}
    assert replicas["replica-a"]["index_blocks"] == 8
    assert replicas["replica-a"]["events"] == "tcp://127.0.0.1:5557"
    assert replicas["replica-b"]["block_size"] == 4 and replicas["replica-b"]["model"] == "m"
    assert (fleet["markers"] / "started").exists()


def test_lookup_tokens_and_text(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    by_tokens = client.post("/v1/lookup", json={"model": "m", "tokens": PROMPT}).json()
    assert by_tokens["prompt_tokens"] == 32
    assert _cached(by_tokens) == {"replica-a": 32, "replica-b": 8}
    longer = client.post("/v1/lookup", json={"model": "m", "tokens": [*PROMPT, 7, 7, 7, 7, 7]})
    assert _cached(longer.json()) == {"replica-a": 32, "replica-b": 8}
    by_text = client.post("/v1/lookup", json={"model": "m", "text": TEXT}).json()
    full = len(TEXT.encode()) // 4 * 4
    assert by_text["prompt_tokens"] == len(TEXT.encode())
    assert _cached(by_text) == {"replica-a": 0, "replica-b": full}
    other = client.post("/v1/lookup", json={"model": "dead", "tokens": PROMPT}).json()
    assert _cached(other) == {"replica-dead": 0}


def test_route_and_release(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    decision = client.post(
        "/v1/route", json={"model": "m", "tokens": PROMPT, "request_id": "route-1"}
    ).json()
    assert decision["replica"] == "replica-a" and decision["policy"] == "prefix"
    assert decision["cached_tokens"] == 32 and decision["rule"] == "prefix"
    assert decision["url"].endswith("/replica-a")
    assert {s["name"] for s in decision["scores"]} == {"replica-a", "replica-b"}
    loads = {r["name"]: r["in_flight"] for r in client.get("/v1/replicas").json()["replicas"]}
    assert loads == {"replica-a": 1, "replica-b": 0, "replica-dead": 0}
    released = client.post("/v1/release", json={"request_id": "route-1"})
    assert released.status_code == 200
    assert released.json() == {"request_id": "route-1", "replica": "replica-a", "prompt_tokens": 32}
    again = client.post("/v1/release", json={"request_id": "route-1"})
    assert again.status_code == 404 and "not in flight" in again.json()["error"]["message"]
    loads = {r["name"]: r["in_flight"] for r in client.get("/v1/replicas").json()["replicas"]}
    assert loads["replica-a"] == 0
    pure = client.post("/v1/route", json={"model": "m", "tokens": PROMPT}).json()
    assert pure["request_id"] is None
    assert client.get("/v1/replicas").json()["replicas"][0]["in_flight"] == 0


@contextlib.contextmanager
def _service(tmp_path: Path, config: str) -> Iterator[httpx.Client]:
    """The service (test launcher) on a free port with ``config`` as its YAML, and a client."""
    port = free_port()
    (tmp_path / "fleet.yaml").write_text(config)
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


def _upstream(port: int, tmp_path: Path, name: str) -> contextlib.AbstractContextManager[str]:
    """The fake OpenAI upstream on ``port``."""
    return running(
        ["tests.fleet.service.fake_openai_upstream", "--port", str(port)], port, tmp_path / name
    )


def test_unreleased_route_load_expires(tmp_path: Path) -> None:
    # a client that routes with an id and never releases: its load ends after the timeout
    config = (
        "routing: {policy: least_loaded, in_flight_timeout_s: 0.5}\n"
        "health: {probe_interval_s: null}\n"  # no probes, though the URL is dead
        f"replicas:\n  - {{name: only, model: m, block_size: 4, url: 'http://127.0.0.1:{free_port()}'}}\n"
    )
    with _service(tmp_path, config) as client:
        body = {"model": "m", "tokens": PROMPT, "request_id": "gone"}
        assert client.post("/v1/route", json=body).status_code == 200

        def in_flight() -> int:
            return int(client.get("/v1/replicas").json()["replicas"][0]["in_flight"])

        assert in_flight() == 1
        wait_until(lambda: in_flight() == 0, "the route's load to expire")
        late = client.post("/v1/release", json={"request_id": "gone"})
        assert late.status_code == 404 and "ended after 0.5 s" in late.json()["error"]["message"]
        assert _metrics(client)["prefixcache_route_expired_total"][()] == 1
        assert client.post("/v1/route", json=body).status_code == 200  # the id is free again
        assert client.get("/v1/replicas").json()["replicas"][0]["up"] is True  # never probed


def test_health_probes_take_replicas_out_and_back(tmp_path: Path) -> None:
    # "late" has nothing listening at first: probes take it out; once it answers, it is back
    up_port, late_port = free_port(), free_port()
    config = (
        "routing: {policy: least_loaded}\n"
        "proxy: {enabled: true}\n"  # probes run in proxy mode
        "health: {probe_interval_s: 0.1, probe_timeout_s: 1, down_s: 0.5}\n"
        "replicas:\n"
        f"  - {{name: alive, model: m, url: 'http://127.0.0.1:{up_port}/alive'}}\n"
        f"  - {{name: late, model: m, url: 'http://127.0.0.1:{late_port}/late'}}\n"
    )
    with _upstream(up_port, tmp_path, "alive.log"), _service(tmp_path, config) as client:

        def up() -> dict[str, bool]:
            return {r["name"]: r["up"] for r in client.get("/v1/replicas").json()["replicas"]}

        wait_until(lambda: up() == {"alive": True, "late": False}, "the probe to find late down")
        body = {"model": "m", "tokens": PROMPT}
        picks = {client.post("/v1/route", json=body).json()["replica"] for _ in range(4)}
        assert picks == {"alive"}
        with _upstream(late_port, tmp_path, "late.log"):
            wait_until(lambda: up() == {"alive": True, "late": True}, "late to come back")
            picks = {client.post("/v1/route", json=body).json()["replica"] for _ in range(4)}
            assert picks == {"alive", "late"}


def test_a_slow_replica_is_a_502_but_stays_up(tmp_path: Path) -> None:
    # a replica that answers too late failed that request only: it keeps taking routes
    up_port = free_port()
    config = (
        "proxy: {enabled: true, timeout_s: 0.3}\n"
        "health: {probe_interval_s: null}\n"
        f"replicas:\n  - {{name: slow, model: m, url: 'http://127.0.0.1:{up_port}/slow'}}\n"
    )
    with _upstream(up_port, tmp_path, "slow.log"), _service(tmp_path, config) as client:
        late = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "wait": 1.0})
        assert late.status_code == 502 and "ReadTimeout" in late.json()["error"]["message"]
        assert client.get("/v1/replicas").json()["replicas"][0]["up"] is True
        quick = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert quick.status_code == 200 and quick.json()["replica"] == "slow"


BAD_REQUESTS = [
    ("/v1/lookup", {"model": "m", "tokens": [1, -2]}, 422, ">= 0"),
    ("/v1/lookup", {"model": "m", "tokens": [1, 2.5]}, 422, "got `float`"),
    ("/v1/lookup", {"model": "m", "tokens": [1, 2.0]}, 422, "got `float`"),
    ("/v1/lookup", {"model": "m", "tokens": [True, 2]}, 422, "got `bool`"),
    ("/v1/lookup", {"model": "m", "tokens": [1, 2**31]}, 422, "<= 2147483647"),
    ("/v1/lookup", {"model": "m", "tokens": [1, 10**30]}, 422, "$.tokens[1]"),
    ("/v1/lookup", {"model": "m", "tokens": [[1, 2]]}, 422, "$.tokens[0]"),
    ("/v1/lookup", {"model": "m", "tokens": []}, 422, "empty"),
    ("/v1/lookup", {"model": "m", "tokens": "123"}, 422, "got `str`"),
    ("/v1/lookup", {"model": "m", "text": ""}, 422, "empty"),
    ("/v1/lookup", {"model": "m"}, 422, "exactly one of"),
    ("/v1/lookup", {"model": "m", "tokens": [1], "text": "x"}, 422, "exactly one of"),
    ("/v1/lookup", {"tokens": [1]}, 422, "missing required field `model`"),
    ("/v1/lookup", {"model": "m", "tokens": [1], "colour": 1}, 422, "unknown field `colour`"),
    ("/v1/lookup", {"model": "nope", "tokens": [1]}, 404, "no replica serves namespace nope"),
    ("/v1/lookup", {"model": "m", "adapter": "nope", "tokens": [1]}, 404, "lora=nope"),
    ("/v1/lookup", {"model": "m", "tokens": list(range(MAX_TOKENS + 1))}, 413, "at most 256"),
    ("/v1/lookup", {"model": "m", "text": "y" * (MAX_TOKENS + 1)}, 413, "at most 256"),
    ("/v1/lookup", {"model": "m", "text": "z" * (MAX_BODY + 10)}, 413, "exceeds the limit"),
    ("/v1/lookup", [1, 2], 422, "Expected `object`"),
    ("/v1/route", {"model": "m", "tokens": [1, -1], "request_id": "bad-1"}, 422, ">= 0"),
    ("/v1/route", {"model": "m", "tokens": PROMPT, "request_id": ""}, 422, "length >= 1"),
    ("/v1/route", {"model": "m", "tokens": PROMPT, "request_id": 7}, 422, "got `int`"),
    ("/v1/route", {"model": "x", "tokens": PROMPT, "request_id": "bad-2"}, 404, "no replica"),
    ("/v1/release", {"request_id": "never-routed"}, 404, "not in flight"),
    ("/v1/release", {}, 422, "missing required field `request_id`"),
]


@pytest.mark.parametrize(("path", "body", "status", "text"), BAD_REQUESTS)
def test_bad_input_is_a_4xx_json_error_and_changes_nothing(
    fleet: dict[str, Any], path: str, body: Any, status: int, text: str
) -> None:
    _refused(fleet["client"], path, body, status, text)


def _refused(client: httpx.Client, path: str, body: Any, status: int, text: str) -> None:
    """``body`` posted to ``path`` gets a ``status`` JSON error naming ``text``, and nothing
    changes."""
    before = _state(client)
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert text in error["message"] and error["status"] == status
    assert _state(client) == before


def test_unknown_paths_and_methods_answer_in_the_json_error_shape(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    for response, status in ((client.get("/v1/lookup"), 405), (client.post("/v1/nothing"), 404)):
        assert response.status_code == status
        error = response.json()["error"]
        assert error["status"] == status and error["type"] in ("MethodNotAllowed", "NotFound")
    assert client.get("/v1/lookup").headers["allow"] == "POST"
    assert (
        _metrics(client)["prefixcache_http_errors_total"][
            (("endpoint", "(unknown)"), ("status", "404"))
        ]
        >= 1
    )


def test_salted_requests_go_to_any_replica_of_the_model(fleet: dict[str, Any]) -> None:
    # vLLM's cache_salt is per request: a replica of the model serves every salt
    client = fleet["client"]
    looked = client.post("/v1/lookup", json={"model": "m", "salt": "tenant-9", "tokens": PROMPT})
    assert looked.status_code == 200
    assert [r["name"] for r in looked.json()["replicas"]] == ["replica-a", "replica-b"]
    assert all(r["cached_tokens"] == 0 for r in looked.json()["replicas"])  # other salt: no hit
    proxied = client.post(
        "/v1/completions",
        json={"model": "m", "prompt": PROMPT, "max_tokens": 1, "cache_salt": "tenant-9"},
    )
    assert proxied.status_code == 200
    assert _in_flight(client) == 0


def test_malformed_json_and_duplicate_ids(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    before = _state(client)
    response = client.post(
        "/v1/route", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    huge = client.post("/v1/lookup", content=b" " * (MAX_BODY + 1))
    assert huge.status_code == 413
    assert _state(client) == before
    first = client.post("/v1/route", json={"model": "m", "tokens": PROMPT, "request_id": "dup"})
    assert first.status_code == 200
    during = _state(client)
    second = client.post("/v1/route", json={"model": "m", "tokens": PROMPT, "request_id": "dup"})
    assert second.status_code == 409 and "already in flight" in second.json()["error"]["message"]
    assert _state(client) == during
    assert client.post("/v1/release", json={"request_id": "dup"}).status_code == 200
    assert _state(client) == before


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _tool_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"model": "m", "messages": [FIRST, {"role": "assistant", "tool_calls": [call]}]}


DEEP = _deep(1000)
HOSTILE = [  # (path, raw body, status): small bodies a client can send anywhere free-form
    ("/v1/completions", '{"model": "m", "prompt": "hi", "x": ' + DEEP + "}", 400),
    ("/v1/lookup", '{"model": "m", "tokens": [1], "x": ' + DEEP + "}", 422),
    (
        "/v1/chat/completions",
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
        '"text": "x", "x": ' + DEEP + "}]}]}",
        400,
    ),
    ("/v1/chat/completions", json.dumps(_tool_call(_deep(5000))), 422),
    ("/v1/chat/completions", json.dumps(_tool_call("9" * 5000)), 422),
    ("/v1/route", json.dumps(_tool_call('{"a": ' + "9" * 5000 + "}")), 422),
]
HOSTILE_IDS = [
    "proxy-unknown-field",
    "lookup-unknown-field",
    "content-part",
    "tool-arguments-nested",
    "tool-arguments-number",
    "route-tool-arguments-number",
]


@pytest.mark.parametrize(("path", "body", "status"), HOSTILE, ids=HOSTILE_IDS)
def test_deep_nesting_and_huge_numbers_are_4xx_and_the_connection_stays_usable(
    fleet: dict[str, Any], path: str, body: str, status: int
) -> None:
    client = fleet["client"]
    before = _state(client)
    errors_before = _metrics(client).get("prefixcache_http_errors_total", {})
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["status"] == status and error["message"]
    assert _state(client) == before  # the same kept-alive connection answers on
    key = (("endpoint", path), ("status", str(status)))
    assert _metrics(client)["prefixcache_http_errors_total"][key] == errors_before.get(key, 0) + 1


def _metrics(client: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def test_metrics(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    before = _metrics(client)
    decisions_key = (("policy", "prefix"), ("replica", "replica-a"), ("rule", "prefix"))
    routed_before = before.get("prefixcache_route_decisions_total", {}).get(decisions_key, 0.0)
    count_before = before.get("prefixcache_route_latency_seconds_count", {}).get((), 0.0)
    for _ in range(3):
        client.post("/v1/route", json={"model": "m", "tokens": PROMPT})
    client.post("/v1/lookup", json={"model": "m", "tokens": [1, -1]})
    after = _metrics(client)
    assert after["prefixcache_route_decisions_total"][decisions_key] == routed_before + 3
    assert after["prefixcache_route_latency_seconds_count"][()] == count_before + 3
    fraction = after["prefixcache_route_cached_fraction_bucket"]
    assert fraction[(("le", "0.99"),)] < fraction[(("le", "1.0"),)]  # the 32/32 routes
    blocks = after["prefixcache_index_blocks"]
    assert blocks[(("replica", "replica-a"),)] == 8
    assert blocks[(("replica", "replica-dead"),)] == 0
    assert after["prefixcache_replica_in_flight"][(("replica", "replica-a"),)] == 0
    assert after["prefixcache_route_expired_total"][()] == 0  # 600 s by default
    assert after["prefixcache_ingest_blocks_stored_total"][(("replica", "replica-a"),)] == 40
    assert after["prefixcache_ingest_sequence_gaps_total"][(("replica", "replica-a"),)] == 1
    assert after["prefixcache_ingest_errors_total"][(("replica", "replica-b"),)] == 2
    errors = after["prefixcache_http_errors_total"]
    assert errors[(("endpoint", "/v1/lookup"), ("status", "422"))] >= 1


# ---- proxy mode -------------------------------------------------------------------------------


def _in_flight(client: httpx.Client) -> int:
    return sum(r["in_flight"] for r in client.get("/v1/replicas").json()["replicas"])


def test_proxy_completion_goes_to_the_prefix_holder(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    response = client.post(
        "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4}
    )
    assert response.status_code == 200
    assert response.headers["x-prefixcache-replica"] == "replica-a"
    assert (
        response.json()["replica"] == "replica-a"
        and response.json()["choices"][0]["text"] == "xxxx"
    )
    text = client.post("/v1/completions", json={"model": "m", "prompt": TEXT})
    assert text.json()["replica"] == "replica-b"
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion.chunk"
    assert _in_flight(client) == 0


def test_chat_routes_on_the_templated_conversation(fleet: dict[str, Any]) -> None:
    # the next turn of a conversation goes where its first turn, as the engine rendered it, is
    client = fleet["client"]
    follow_up = [SYSTEM, FIRST, {"role": "assistant", "content": "replica-b"}]
    follow_up.append({"role": "user", "content": [{"type": "text", "text": "Sure?"}]})
    lookup = client.post("/v1/lookup", json={"model": "m", "messages": follow_up}).json()
    assert _cached(lookup) == {"replica-a": 0, "replica-b": len(SEEN.encode()) // 4 * 4}
    assert lookup["prompt_tokens"] > len(SEEN.encode())
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": follow_up})
    assert chat.status_code == 200 and chat.headers["x-prefixcache-replica"] == "replica-b"
    both = client.post("/v1/lookup", json={"model": "m", "messages": follow_up, "text": "x"})
    assert both.status_code == 422 and "exactly one of" in both.json()["error"]["message"]
    bad = {"model": "m", "messages": follow_up, "add_generation_prompt": "yes"}
    refused = client.post("/v1/chat/completions", json=bad)
    assert refused.status_code == 422 and "add_generation_prompt" in refused.text
    assert _in_flight(client) == 0


def test_proxy_streams_events_as_they_arrive(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    body = {"model": "m", "prompt": PROMPT, "stream": True, "max_tokens": 5, "delay": 0.05}
    events = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:  # mid-stream: the request is still counted as load
                    assert _in_flight(client) == 1
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["index"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert all(json.loads(e)["replica"] == "replica-a" for e in events[:-1])
    wait_until(lambda: _in_flight(client) == 0, "the load to be released")


def test_proxy_stream_cut_by_the_replica_ends_with_an_error_event(fleet: dict[str, Any]) -> None:
    # it ended as a short answer, which a client could not tell from a complete one
    client = fleet["client"]
    body = {"model": "m", "prompt": PROMPT, "stream": True, "max_tokens": 5, "break_after": 2}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e).get("index") for e in events[:2]] == [0, 1]
    error = json.loads(events[-1])["error"]
    assert error["type"] == "UpstreamError" and "broke off" in error["message"]
    wait_until(lambda: _in_flight(client) == 0, "the load to be released")


def test_proxy_releases_on_client_disconnect(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    body = {"model": "m", "prompt": PROMPT, "stream": True, "max_tokens": 400, "delay": 0.02}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # held: dropping the iterator would close the stream
        first = next(lines)
        assert first.startswith("data: ")
        assert _in_flight(client) == 1
    wait_until(lambda: _in_flight(client) == 0, "the load of the dropped stream to be released")


def test_proxy_upstream_down_is_502_and_released(fleet: dict[str, Any]) -> None:
    client = fleet["client"]
    response = client.post("/v1/completions", json={"model": "dead", "prompt": "hello"})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "UpstreamError" and "replica-dead" in error["message"]
    assert _in_flight(client) == 0
    # the unreachable replica takes no more routes for health.down_s
    dead = next(r for r in client.get("/v1/replicas").json()["replicas"] if r["model"] == "dead")
    assert dead["up"] is False and dead["down_reason"] == "request failed: ConnectError"
    assert 0 < dead["down_for_s"] <= 60 and dead["marked_down"] == 1
    again = client.post("/v1/completions", json={"model": "dead", "prompt": "hello"})
    assert again.status_code == 503 and again.json()["error"]["type"] == "NoHealthyReplicaError"
    assert 1 <= int(again.headers["retry-after"]) <= 60
    route = client.post("/v1/route", json={"model": "dead", "tokens": PROMPT})
    assert route.status_code == 503
    assert client.post("/v1/lookup", json={"model": "dead", "tokens": PROMPT}).status_code == 200
    metrics = _metrics(client)
    assert metrics["prefixcache_replica_up"][(("replica", "replica-dead"),)] == 0
    assert metrics["prefixcache_replica_up"][(("replica", "replica-a"),)] == 1
    assert metrics["prefixcache_replica_marked_down_total"][(("replica", "replica-dead"),)] == 1
    assert client.get("/healthz").json()["replicas_up"] == 2


@pytest.mark.parametrize(
    ("path", "body", "status", "text"),
    [
        ("/v1/completions", {"model": "m", "prompt": [1, -5]}, 422, ">= 0"),
        ("/v1/completions", {"model": "m", "prompt": [1, True]}, 422, "got True"),
        ("/v1/completions", {"model": "m", "prompt": 5}, 422, "'prompt' must be"),
        ("/v1/completions", {"model": "zzz", "prompt": "hi"}, 404, "no replica serves model"),
        ("/v1/completions", {"prompt": "hi"}, 422, "'model'"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, 422, "role"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 422, "'messages'"),
    ],
)
def test_proxy_bad_input(
    fleet: dict[str, Any], path: str, body: Any, status: int, text: str
) -> None:
    _refused(fleet["client"], path, body, status, text)


# ---- lifecycle and command line ---------------------------------------------------------------


def test_ingest_source_starts_and_stops_with_the_app(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text("replicas: [{name: replica-a, model: m}]\n")
    port = free_port()
    args = ["tests.fleet.service.fleet_launcher", "--config", str(tmp_path / "fleet.yaml")]
    args += ["--port", str(port), "--markers", str(tmp_path)]
    with running(args, port, tmp_path / "service.log"):
        assert (tmp_path / "started").exists() and not (tmp_path / "stopped").exists()
    assert (tmp_path / "stopped").exists()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("replicas: []\n", "replicas: expected a non-empty list"),
        ("replicas: [{name: a, model: m, block_size: -4}]\n", "replicas[0].block_size"),
        ("replicas: [{name: a, model: m}]\nindex: mysql://x\n", "expected 'memory', 'redis"),
        ("replicas: [{name: a, model: m}]\nrouting: {policy: random}\n", "unknown policy"),
        ("replicas: [{name: a}\n", "not valid YAML"),
    ],
)
def test_cli_bad_config_is_one_line_and_exit_2(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml_text)
    done = subprocess.run(
        [sys.executable, "-m", "prefixcache", "serve", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("prefixcache serve: error: ") and message in lines[0]
