"""Proxy mode when a replica fails or a client leaves early, over real HTTP: the service and the
fake OpenAI upstream in subprocesses on 127.0.0.1.

- A replica that refuses the connection (crashed) received nothing: the request goes to another
  replica, and the crashed one is marked down at once. Once a request's bytes were sent, it is
  never sent again (the engine may be running it).
- A streamed answer whose client closes right after ``data: [DONE]`` keeps its cached-token
  figure: the usage chunk is read as it passes, whatever the client does next.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.fleet.fleet_processes import running
from tests.fleet_support import free_port, wait_until

PROMPT = list(range(1, 33))  # 8 blocks of 4 tokens


@contextlib.contextmanager
def _fleet(tmp_path: Path, replicas: str, seed: list[dict[str, Any]]) -> Iterator[httpx.Client]:
    """The service (proxy on, no health probes) over ``replicas``, its index seeded."""
    port = free_port()
    (tmp_path / "fleet.yaml").write_text(
        "index: memory\nrouting: {policy: prefix}\nproxy: {enabled: true, timeout_s: 30}\n"
        "health: {probe_interval_s: null, down_s: 60}\n" + replicas
    )
    (tmp_path / "seed.json").write_text(json.dumps(seed))
    args = ["tests.fleet.service.fleet_launcher", "--config", str(tmp_path / "fleet.yaml"),
            "--port", str(port), "--seed", str(tmp_path / "seed.json")]  # fmt: skip
    with (
        running(args, port, tmp_path / "service.log") as base,
        httpx.Client(base_url=base, timeout=30.0) as client,
    ):
        yield client


@contextlib.contextmanager
def _upstream(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    args = ["tests.fleet.service.fake_openai_upstream", "--port", str(port)]
    with running(args, port, tmp_path / "upstream.log") as base:
        yield base


@contextlib.contextmanager
def _swallowing_server() -> Iterator[tuple[str, list[bytes]]]:
    """A replica that reads a request and closes the connection without answering (it crashed
    after the request reached it); yields its URL and the requests it read."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5.0)
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        break
                    data += more
                received.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", received
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def _replicas(client: httpx.Client) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in client.get("/v1/replicas").json()["replicas"]}


def _decisions(client: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "prefixcache_route_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    name = sample.labels["replica"]
                    out[name] = out.get(name, 0) + sample.value
    return out


def test_a_refused_connection_goes_to_another_replica_and_marks_the_crashed_one_down(
    tmp_path: Path,
) -> None:
    dead = free_port()  # nothing listens: the replica crashed
    with _upstream(tmp_path) as upstream:
        replicas = (
            "replicas:\n"
            f"  - {{name: crashed, model: m, block_size: 4, url: 'http://127.0.0.1:{dead}'}}\n"
            f"  - {{name: alive, model: m, block_size: 4, url: '{upstream}/alive'}}\n"
        )
        seed = [{"replica": "crashed", "tokens": PROMPT}]  # the prefix holder is the crashed one
        with _fleet(tmp_path, replicas, seed) as client:
            for stream in (False, True):
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "stream": stream}
                answer = client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-prefixcache-replica"] == "alive"
            rows = _replicas(client)
            assert rows["crashed"]["up"] is False
            assert rows["crashed"]["down_reason"] == "request failed: ConnectError"
            assert rows["crashed"]["marked_down"] == 1
            assert rows["crashed"]["in_flight"] == 0 and rows["alive"]["in_flight"] == 0
            assert httpx.get(f"{upstream}/alive/served").json() == {"served": 2}


def test_every_replica_refusing_is_a_502_after_a_bounded_number_of_tries(tmp_path: Path) -> None:
    replicas = "replicas:\n" + "".join(
        f"  - {{name: r{i}, model: m, block_size: 4, url: 'http://127.0.0.1:{free_port()}'}}\n"
        for i in range(5)
    )
    with _fleet(tmp_path, replicas, []) as client:
        answer = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
        assert answer.status_code == 502
        assert "ConnectError" in answer.json()["error"]["message"]
        tried = [r for r in _replicas(client).values() if not r["up"]]
        assert len(tried) == 3  # the first choice and two more
        assert sum(r["in_flight"] for r in _replicas(client).values()) == 0


def test_a_request_that_reached_a_replica_is_never_sent_again(tmp_path: Path) -> None:
    with _upstream(tmp_path) as upstream, _swallowing_server() as (swallower, received):
        replicas = (
            "replicas:\n"
            f"  - {{name: swallower, model: m, block_size: 4, url: '{swallower}'}}\n"
            f"  - {{name: alive, model: m, block_size: 4, url: '{upstream}/alive'}}\n"
        )
        seed = [{"replica": "swallower", "tokens": PROMPT}]
        with _fleet(tmp_path, replicas, seed) as client:
            answer = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
            assert answer.status_code == 502
            assert "swallower" in answer.json()["error"]["message"]
            assert len(received) == 1
            assert _decisions(client) == {"swallower": 1}
            assert httpx.get(f"{upstream}/alive/served").json() == {"served": 0}


def test_a_stream_closed_right_after_done_keeps_its_cached_token_figure(tmp_path: Path) -> None:
    with _upstream(tmp_path) as upstream:
        replicas = f"replicas:\n  - {{name: a, model: m, block_size: 4, url: '{upstream}/a'}}\n"
        with _fleet(tmp_path, replicas, [{"replica": "a", "tokens": PROMPT}]) as client:
            body = {
                "model": "m",
                "prompt": PROMPT,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
                "report_cached": 28,
                "linger": 30,  # the response ends long after [DONE]
            }
            with client.stream("POST", "/v1/completions", json=body) as answer:
                assert answer.status_code == 200
                for line in answer.iter_lines():
                    if line == "data: [DONE]":
                        break  # and close, as the openai SDK does
            wait_until(
                lambda: sum(r["in_flight"] for r in _replicas(client).values()) == 0,
                "the closed stream's load to end",
            )
            stats = client.get("/v1/stats").json()
            assert stats["unreported_requests"] == 0
            assert stats["attribution"] == [
                {
                    "tenant": None,
                    "model": "m",
                    "requests": 1,
                    "prompt_tokens": 32,
                    "available_tokens": 32,
                    "captured_tokens": 32,
                    "delivered_tokens": 28,
                }
            ]
