"""examples/fleet: tiny replicas with real caches behind `prefixcache serve`, routed by policy.

The replica's HTTP API is checked in process; the whole fleet (replica and router subprocesses
on 127.0.0.1) runs once with round robin and once with prefix routing.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from prefixcache.text.tokenizers import render_chat
from tests.fleet.fleet_processes import load_fleet_example


@pytest.fixture(scope="module")
def replica_client() -> Iterator[TestClient]:
    replica_mod = load_fleet_example("replica")
    replica = replica_mod.Replica(
        model_name="tiny-random",
        events="tcp://127.0.0.1:*",
        replay="tcp://127.0.0.1:*",
        num_blocks=32,
        block_size=16,
    )
    try:
        with TestClient(replica_mod.create_app(replica)) as client:
            yield client
    finally:
        replica.close()


def test_replica_reports_cached_prompt_tokens(replica_client: TestClient) -> None:
    client = replica_client
    system = list(range(40, 90))  # 50 tokens: 3 full blocks of 16
    first = client.post(
        "/v1/completions", json={"model": "tiny-random", "prompt": [*system, 7], "max_tokens": 3}
    )
    assert first.status_code == 200, first.text
    body = first.json()
    assert len(body["choices"][0]["token_ids"]) == 3
    assert body["usage"]["prompt_tokens"] == 51
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    second = client.post(
        "/v1/completions", json={"model": "tiny-random", "prompt": [*system, 9, 9], "max_tokens": 2}
    )
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48

    stats = client.get("/stats").json()
    assert (stats["requests"], stats["prompt_tokens"], stats["cached_tokens"]) == (2, 103, 48)
    assert stats["blocks"]["active"] == 0  # both requests released
    assert stats["events_published"] >= 1
    health = client.get("/healthz").json()
    assert health["events"].startswith("tcp://127.0.0.1:")
    assert health["capacity_blocks"] == 32


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny-random", "prompt": [1, 600], "max_tokens": 2},  # id outside the vocab
        {"model": "tiny-random", "prompt": [], "max_tokens": 2},
        {"model": "tiny-random", "prompt": [1, 2], "max_tokens": 0},
        {"model": "other", "prompt": [1, 2], "max_tokens": 2},
        {"model": "tiny-random", "prompt": [1, 2], "stream": "yes"},
        {"model": "tiny-random", "prompt": list(range(500)) + [0] * 100, "max_tokens": 2},
    ],
)
def test_replica_rejects_bad_requests(replica_client: TestClient, body: dict[str, object]) -> None:
    client = replica_client
    before = client.get("/stats").json()
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"]
    assert client.get("/stats").json() == before


def test_prefix_routing_beats_round_robin_on_a_real_fleet(tmp_path: Path) -> None:
    run_fleet = load_fleet_example("run_fleet")
    processes: list[subprocess.Popen[bytes]] = []
    system_len = 96  # 6 full blocks
    rr, px = run_fleet.run(
        ("round_robin", "prefix"),
        num_replicas=2,
        num_requests=20,
        num_systems=3,
        system_len=system_len,
        max_tokens=2,
        log_dir=tmp_path,
        processes=processes,
    )
    assert processes and all(proc.returncode is not None for proc in processes)
    assert (rr.policy, px.policy) == ("round_robin", "prefix")
    for result in (rr, px):
        assert result.requests == 20
        assert sum(result.per_replica.values()) == 20
        assert result.prompt_tokens > 20 * system_len
        # the router's index learned the replicas' blocks from their KV events
        assert result.ingest_events > 0
        assert sum(result.index_blocks.values()) > 0
        assert result.lookup_cached_tokens >= system_len
    assert list(rr.per_replica.values()) == [10, 10]
    assert px.cached_fraction > rr.cached_fraction
    # with every replica's cache larger than the workload, the gap is the cold misses: round
    # robin pays each system prompt once per replica that sees it, prefix routing once
    assert px.cached_tokens - rr.cached_tokens >= system_len
    print(run_fleet.table([rr, px]))


def test_a_replica_that_fails_to_start_stops_the_fleet(tmp_path: Path) -> None:
    run_fleet = load_fleet_example("run_fleet")
    processes: list[subprocess.Popen[bytes]] = []
    with pytest.raises(RuntimeError, match="exited with"):
        run_fleet.run(
            ("prefix",),
            num_replicas=2,
            num_requests=2,
            num_blocks=0,  # the replicas refuse an empty cache
            log_dir=tmp_path,
            processes=processes,
        )
    assert len(processes) == 2
    assert all(proc.returncode is not None for proc in processes)


def test_replica_reads_json_whatever_the_content_type(replica_client: TestClient) -> None:
    """``curl -d '{...}'`` sends application/x-www-form-urlencoded; the body is JSON still."""
    body = b'{"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 2}'
    headers = {"content-type": "application/x-www-form-urlencoded"}
    resp = replica_client.post("/v1/completions", content=body, headers=headers)
    assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 2
    bad = replica_client.post("/v1/completions", content=b"not json", headers=headers)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def _sse_data(lines: Iterator[str]) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def _chunks(data: list[str]) -> list[dict[str, object]]:
    assert data and data[-1] == "[DONE]", data
    return [json.loads(d) for d in data[:-1]]


def test_replica_streams_a_completion(replica_client: TestClient) -> None:
    client = replica_client
    before = client.get("/stats").json()
    body = {
        "model": "tiny-random",
        "prompt": list(range(100, 140)),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = _chunks(_sse_data(resp.iter_lines()))
    assert len(chunks) == 5  # one per token, then the finish
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    choices = [c["choices"][0] for c in chunks]  # type: ignore[index]
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]
    assert all(len(c["token_ids"]) == 1 for c in choices[:4])
    assert chunks[-1]["usage"]["prompt_tokens"] == 40  # type: ignore[index]
    assert chunks[-1]["usage"]["completion_tokens"] == 4  # type: ignore[index]
    after = client.get("/stats").json()
    assert after["requests"] == before["requests"] + 1
    assert after["completion_tokens"] == before["completion_tokens"] + 4
    assert after["blocks"]["active"] == 0  # released
    assert after["events_published"] > before["events_published"]


def test_replica_answers_chat_completions(replica_client: TestClient) -> None:
    client = replica_client
    messages = [
        {"role": "system", "content": "You are a terse assistant for a tiny random model."},
        {"role": "user", "content": "Say something."},
    ]
    rendered = len(render_chat(messages).encode("utf-8"))
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 3}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == rendered  # rendered as the service renders it
    assert answer["usage"]["completion_tokens"] == 3

    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = _chunks(_sse_data(resp.iter_lines()))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len(deltas) == 5 and deltas[-1] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]

    bad = client.post("/v1/chat/completions", json={"model": "tiny-random", "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def _cached_on(client: httpx.Client, service: str, messages: list[dict[str, str]]) -> dict:
    resp = client.post(f"{service}/v1/lookup", json={"model": "tiny-random", "messages": messages})
    resp.raise_for_status()
    return {s["name"]: s["cached_tokens"] for s in resp.json()["replicas"]}


def test_streams_and_chats_through_the_proxy(tmp_path: Path) -> None:
    run_fleet = load_fleet_example("run_fleet")
    procs = run_fleet.Processes(tmp_path)
    with (
        httpx.Client(timeout=60.0) as client,
        run_fleet.start_fleet("prefix", procs, client, num_replicas=2, num_blocks=64) as fleet,
    ):
        service = fleet.service
        body = {"model": "tiny-random", "prompt": "a streamed prompt", "max_tokens": 5}
        with client.stream(
            "POST", f"{service}/v1/completions", json={**body, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            chunks = _chunks(_sse_data(resp.iter_lines()))
        assert len(chunks) == 6
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]

        conversation = [
            {"role": "system", "content": "You answer questions about prefix caches. " * 3},
            {"role": "user", "content": "What is a block?"},
        ]
        first = client.post(
            f"{service}/v1/chat/completions",
            json={"model": "tiny-random", "messages": conversation, "max_tokens": 4},
        )
        assert first.status_code == 200, first.text
        assert first.json()["object"] == "chat.completion"
        served = first.headers["x-prefixcache-replica"]
        reply = first.json()["choices"][0]["message"]
        conversation += [reply, {"role": "user", "content": "And a prefix?"}]

        deadline = time.monotonic() + 10.0  # until the router's index has the first turn
        while (cached := _cached_on(client, service, conversation)).get(served, 0) == 0:
            assert time.monotonic() < deadline, cached
            time.sleep(0.05)
        assert cached[served] >= 128 and max(cached.values()) == cached[served]

        second = client.post(
            f"{service}/v1/chat/completions",
            json={"model": "tiny-random", "messages": conversation, "max_tokens": 2},
        )
        assert second.status_code == 200, second.text
        assert second.headers["x-prefixcache-replica"] == served
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[served]
    assert procs.procs and all(proc.returncode is not None for proc in procs.procs)
