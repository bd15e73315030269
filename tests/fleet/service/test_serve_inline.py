"""Where the service routes: on the event loop for a token-id prompt on an in-process index,
in the thread pool for text, long prompts and a remote index, with the same answers either way;
``prefixcache serve --workers`` refuses an in-process index and serves over a shared Redis one."""

from __future__ import annotations

import asyncio
import gc
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from prefixcache.fleet.service.dispatch import INLINE_MAX_TOKENS, FleetService
from tests.fleet.fleet_processes import ROOT, running
from tests.fleet.service.serve_harness import BLOCK, MODEL, engine_stores, make_app, make_config
from tests.fleet_support import free_port


def seeded(tmp_path: Path, inline: bool) -> tuple[Any, FleetService, list[str]]:
    """An app without keys over an index where r1 holds prompt A and r2 a longer prefix of it;
    ``inline`` as the service decides it, or forced off. Records the thread of each route."""
    limits = {"max_prompt_tokens": 65536, "max_body_bytes": 1 << 20}
    config = make_config(tmp_path, keys=False, extra={"limits": limits})
    app, index = make_app(config)
    engine_stores(index, "r1", list(range(8)), None)
    engine_stores(index, "r2", list(range(16)), None)
    service: FleetService = app.state.service
    assert service.inline
    service.inline = inline
    threads: list[str] = []
    route = service.router.route

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return route(*args, **kwargs)

    service.router.route = recording  # type: ignore[method-assign]
    return app, service, threads


async def answers(app: Any) -> list[Any]:
    bodies = [
        {"model": MODEL, "tokens": list(range(20))},
        {"model": MODEL, "tokens": list(range(10)), "request_id": "q1"},
        {"model": MODEL, "tokens": list(range(20)), "request_id": "q2"},
        {"model": MODEL, "text": "hello there"},
        {"model": MODEL, "tokens": [5, 6, 7, 8]},
    ]
    out: list[Any] = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for body in bodies:
            out.append((await client.post("/v1/route", json=body)).json())
        out.append((await client.post("/v1/lookup", json=bodies[0])).json())
        out.append((await client.post("/v1/release", json={"request_id": "q1"})).json())
        again = await client.post("/v1/release", json={"request_id": "q1"})
        out.append((again.status_code, again.json()["error"]["type"]))
        dup = await client.post("/v1/route", json=bodies[2])
        out.append((dup.status_code, dup.json()["error"]["type"]))
        bad = await client.post("/v1/route", json={"model": MODEL, "tokens": [-1]})
        out.append((bad.status_code, bad.json()["error"]["type"]))
    return out


def test_inline_routes_answer_as_the_thread_pool_does(tmp_path: Path) -> None:
    app_in, _, threads_in = seeded(tmp_path, inline=True)
    app_pool, _, threads_pool = seeded(tmp_path, inline=False)
    got_in = asyncio.run(answers(app_in))
    got_pool = asyncio.run(answers(app_pool))
    assert got_in == got_pool
    assert got_in[0]["replica"] == "r2" and got_in[0]["cached_tokens"] == 16
    assert got_in[5]["replicas"] == got_pool[5]["replicas"] and got_in[6]["request_id"] == "q1"
    assert got_in[-3][0] == 404 and got_in[-2][0] == 409 and got_in[-1][0] == 422
    main = threading.main_thread().name
    # token ids on the loop; the text prompt (the tokenizer) in the pool
    assert threads_in[:3] == [main] * 3 and threads_in[3] != main and threads_in[4] == main
    assert main not in threads_pool


def test_long_prompts_leave_the_event_loop(tmp_path: Path) -> None:
    app, _, threads = seeded(tmp_path, inline=True)
    sizes = [INLINE_MAX_TOKENS, INLINE_MAX_TOKENS + 1]

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            codes = []
            for n in sizes:
                body = {"model": MODEL, "tokens": list(range(n))}
                codes.append((await client.post("/v1/route", json=body)).status_code)
            return codes

    assert asyncio.run(run()) == [200, 200]
    main = threading.main_thread().name
    assert threads[0] == main and threads[1] != main


def test_redis_index_routes_in_the_thread_pool(tmp_path: Path, redis_server: Any) -> None:
    from prefixcache.fleet.index.from_url import open_index
    from prefixcache.fleet.service.assembly import build_service

    config = make_config(tmp_path, keys=False)
    index = open_index(redis_server.url, prefix="inline-test")
    app = build_service(config, index=index, ingest=None)
    assert app.state.service.inline is False


def write_config(tmp_path: Path, index: str) -> Path:
    path = tmp_path / "fleet.yaml"
    data = {
        "index": index,
        "index_prefix": "workers-test",
        "health": {"probe_interval_s": None},
        "replicas": [{"name": f"r{i}", "model": MODEL, "block_size": BLOCK} for i in (1, 2)],
    }
    path.write_text(yaml.safe_dump(data))
    return path


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("index", ["memory", "memory+compact"])
def test_workers_refuse_an_in_process_index(tmp_path: Path, index: str) -> None:
    cfg = write_config(tmp_path, index)
    done = serve("--config", str(cfg), "--port", str(free_port()), "--workers", "2")
    assert done.returncode == 2
    assert "--workers 2 needs a shared index" in done.stderr and "redis://" in done.stderr
    assert "Traceback" not in done.stderr


def test_workers_must_be_positive(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "memory")
    done = serve("--config", str(cfg), "--port", str(free_port()), "--workers", "0")
    assert done.returncode == 2 and "--workers must be a positive integer" in done.stderr


def test_workers_serve_over_a_shared_redis_index(tmp_path: Path, redis_server: Any) -> None:
    from prefixcache.blocks.hashing import BlockHasher
    from prefixcache.blocks.namespace import Namespace
    from prefixcache.fleet.index.from_url import open_index

    cfg = write_config(tmp_path, "memory")
    index = open_index(redis_server.url, prefix="workers-test")
    digests = BlockHasher(BLOCK).hash_prompt(list(range(12)), Namespace(MODEL))
    index.store("r2", digests)
    index.flush()  # written behind: in Redis once flushed
    port = free_port()
    args = ["prefixcache", "serve", "--config", str(cfg), "--port", str(port)]
    args += ["--index", redis_server.url, "--workers", "2"]
    with (
        running(args, port, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base) as client,
    ):
        for _ in range(6):  # new connections: the workers take them in turn or not
            answer = client.post(
                "/v1/route",
                json={"model": MODEL, "tokens": list(range(12))},
                headers={"connection": "close"},
            ).json()
            assert answer["replica"] == "r2" and answer["cached_tokens"] == 12
        # the workers' protocol keeps the head limits (server.max_header_bytes: 16 KiB)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
            )
            answer_bytes = b""
            while chunk := sock.recv(65536):
                answer_bytes += chunk
        assert answer_bytes.startswith(b"HTTP/1.1 431 ")
    log = (tmp_path / "serve.log").read_text()
    assert log.count("Started server process") == 2


def test_worker_connections_turn_nagle_off() -> None:
    """A listening socket made as uvicorn makes it for workers (no protocol number): asyncio
    leaves Nagle on for its connections, ``no_delay`` turns it off."""
    from prefixcache.fleet.service.startup import no_delay

    async def accepted(fix: bool) -> int:
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                if fix:
                    no_delay(transport)
                sock = transport.get_extra_info("socket")
                got.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted(False)) == 0
    assert asyncio.run(accepted(True)) != 0


def test_what_exists_at_startup_is_frozen_for_the_service_s_life(tmp_path: Path) -> None:
    """The collector's full passes skip the objects of a started service (modules, app, index),
    and the freeze is lifted when it stops."""
    app, _ = make_app(make_config(tmp_path, keys=False))
    assert gc.get_freeze_count() == 0
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 10_000
        assert client.get("/healthz").status_code == 200
    assert gc.get_freeze_count() == 0
