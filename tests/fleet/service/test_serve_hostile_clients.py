"""What one hostile client can do to ``prefixcache serve`` run in a subprocess with its open-file
limit lowered to 256 (``tests/fleet/service/limited_serve.py``): it sends 300 requests over raw
sockets, each a full head and 1 of 50 body bytes, and holds them. Health checks from another address
still answer within a second, another client's routes succeed, and once the hostile client
closes its sockets the service answers at once. The budget itself (``connection_budget``) is
checked without a server: what the limit leaves, the warning naming what to raise."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixcache.errors import ConfigError
from prefixcache.fleet.service.configuration.access_config import ServerConfig
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.fleet.service.guards.connection_budget import (
    ACCEPT_HEADROOM,
    RESERVED_DESCRIPTORS,
    connection_budget,
)
from prefixcache.fleet.service.transport import (
    ACCEPT_BATCH,
    LISTEN_BACKLOG,
    BatchedAcceptServer,
    uvicorn_config,
)
from tests.fleet.fleet_processes import running
from tests.fleet.service.serve_harness import make_app, make_config, serving
from tests.fleet_support import free_port, wait_until

NOFILE = 256
HOSTILE = "127.0.0.2"  # the hostile client's address (Linux answers all of 127/8 on lo)
PROBE = "127.0.0.1"  # the load balancer's health checks
OTHER = "127.0.0.3"  # another client, routing
HOSTILE_REQUESTS = 300
BODY_BYTES = 50
REFUSALS_S = 20.0  # time the service gets to answer the requests past the client's share
ROUTE = {"model": "m", "tokens": [1, 2, 3, 4, 5, 6, 7, 8]}


@contextlib.contextmanager
def _limited_service(tmp_path: Path, server: dict[str, Any]) -> Iterator[str]:
    """``prefixcache serve`` with ``server`` as its server section, under ``NOFILE`` open files;
    its base URL."""
    config = {
        "index": "memory",
        "health": {"probe_interval_s": None},
        "server": server,
        "replicas": [
            {"name": "r1", "model": "m", "block_size": 4},
            {"name": "r2", "model": "m", "block_size": 4},
        ],
    }
    (tmp_path / "fleet.yaml").write_text(json.dumps(config))
    port = free_port()
    args = ["tests.fleet.service.limited_serve", str(NOFILE), "serve"]
    args += ["--config", str(tmp_path / "fleet.yaml"), "--port", str(port)]
    with running(args, port, tmp_path / "service.log") as base:
        yield base


def _partial_requests(base: str, n: int, source: str) -> list[socket.socket]:
    """``n`` connections from ``source``, each with a full request head and 1 body byte."""
    port = int(base.rsplit(":", 1)[1])
    head = (
        "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BODY_BYTES}\r\n\r\n{{"
    ).encode()
    socks = []
    for k in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        sock.sendall(head)
        sock.setblocking(False)
        socks.append(sock)
        if k % 25 == 24:  # in waves, as a client's pool fills: not all in one accept
            time.sleep(0.02)
    return socks


def _answered(socks: list[socket.socket], done: set[int]) -> int:
    """How many of ``socks`` the server has answered or closed (``done`` keeps their indexes)."""
    for k, sock in enumerate(socks):
        if k in done:
            continue
        try:
            sock.recv(65536)  # an answer (429, 503), or b"" once closed
        except BlockingIOError:
            continue  # held: nothing yet
        except OSError:
            pass  # reset: closed too
        done.add(k)
    return len(done)


def _wait_for(check: Callable[[], bool], seconds: float) -> None:
    """Until ``check()`` or ``seconds`` have passed (what follows asserts the outcome)."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def _get_health(base: str, source: str) -> int:
    """``GET /health`` from ``source``, the client giving up after a second."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=1.0) as client:
        return client.get(f"{base}/health").status_code


def _route(base: str, source: str) -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=5.0) as client:
        return client.post(f"{base}/v1/route", json=ROUTE).status_code


@pytest.mark.skipif(sys.platform != "linux", reason="clients from 127.0.0.2 need Linux's loopback")
@pytest.mark.parametrize(
    ("server", "needed"),
    [
        ({"http": "httptools"}, 1000 + RESERVED_DESCRIPTORS + ACCEPT_HEADROOM),
        ({"http": "h11", "max_connections": 200}, 200 + RESERVED_DESCRIPTORS + ACCEPT_HEADROOM),
    ],
    ids=["httptools-default-limits", "h11-max-connections-200"],
)
def test_one_client_holding_partial_requests_leaves_health_and_routes_answering(
    tmp_path: Path, server: dict[str, Any], needed: int
) -> None:
    if server["http"] == "httptools":
        pytest.importorskip("httptools")
    budget = connection_budget(
        parse_config({"replicas": [{"name": "r", "model": "m"}], "server": server}).server,
        0,
        (NOFILE, NOFILE),
    )
    assert budget.max_requests_per_client is not None
    with _limited_service(tmp_path, server) as base:
        assert _get_health(base, PROBE) == 200
        hostile = _partial_requests(base, HOSTILE_REQUESTS, HOSTILE)
        try:
            done: set[int] = set()
            # the requests past the client's share are refused at once, their sockets freed
            refused = HOSTILE_REQUESTS - budget.max_requests_per_client
            _wait_for(lambda: _answered(hostile, done) >= refused, REFUSALS_S)
            for _ in range(3):
                assert _get_health(base, PROBE) == 200  # within the client's 1 s timeout
                assert _route(base, OTHER) == 200
            held = HOSTILE_REQUESTS - _answered(hostile, done)
            assert 0 < held <= budget.max_requests_per_client  # the client does hold its share
            # the burst never ran the process out of descriptors (asyncio would have stopped
            # accepting, health checks included, for a second: 1801 failed accepts before)
            assert _counter(base, "prefixcache_accept_failures_total") == 0
        finally:
            for sock in hostile:
                sock.close()
        # once it lets go, the service answers at once
        assert _get_health(base, PROBE) == 200
        assert _route(base, OTHER) == 200
        assert _route(base, HOSTILE) == 200  # the hostile address is not banned either
    log = (tmp_path / "service.log").read_text()
    assert "Traceback" not in log
    assert f"ulimit -n {needed}" in log  # the start says what limit the config needs
    assert len(log.splitlines()) < 30, log  # no line per refused connection


@pytest.mark.skipif(sys.platform != "linux", reason="clients from 127.0.0.3 need Linux's loopback")
def test_a_request_past_the_clients_share_gets_429_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, keys=False, extra={"server": {"max_connections": 10}})
    app, _ = make_app(config)
    with serving(app, config) as base:
        held = _partial_requests(base, 5, PROBE)  # half of 10: the client's share
        try:
            assert _get_health(base, PROBE) == 200  # never refused; and all 5 have started
            port = int(base.rsplit(":", 1)[1])
            sixth = socket.create_connection(("127.0.0.1", port), timeout=5)
            sixth.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            answer = _closed_by_server(sixth)
            assert answer.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in answer.lower()
            assert b'"type":"TooManyRequests"' in answer
            assert b"server.max_requests_per_client" in answer
            assert _route(base, OTHER) == 200  # another address has its own share
        finally:
            for sock in held:
                sock.close()
        assert _route(base, PROBE) == 200  # its share is back as its requests end
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'prefixcache_rejected_requests_total{key="-",reason="client_limit"} 1.0' in metrics


def _closed_by_server(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_connections_past_the_budget_close_the_ones_waiting_longest(tmp_path: Path) -> None:
    """Silent connections (no head yet) past ``max_connections``: each new one closes the one
    that has waited longest (one address here), counted as evicted; the new ones are served."""
    config = make_config(tmp_path, keys=False, extra={"server": {"max_connections": 4}})
    app, _ = make_app(config)
    with serving(app, config) as base:
        before = _counter(base, EVICTED)
        port = int(base.rsplit(":", 1)[1])
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        newer = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        try:
            for sock in silent[:3]:
                assert sock.recv(1) == b""  # closed, unanswered: the three waiting longest
            # the newest is served, and says what happened (on its own connection: a new one
            # would close another)
            newer[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _answer(newer[-1])
            assert answer.startswith(b"HTTP/1.1 200 ")
            evicted = _counter_in(answer.decode(), EVICTED)
            assert evicted - before == 3
            assert _counter_in(answer.decode(), CLOSED_OVER_LIMIT) == 0  # none refused
        finally:
            for sock in silent + newer:
                sock.close()


def test_while_every_connection_is_busy_health_is_answered_and_other_requests_get_503(
    tmp_path: Path,
) -> None:
    """``max_connections`` requests the app is working on (none waits on its client, so none
    can be closed): a new connection's health check is answered, any other request gets 503,
    and once they end the service answers again."""
    config = make_config(tmp_path, keys=False, extra={"server": {"max_connections": 4}})
    app = _BusyApp()
    port = free_port()
    server = BatchedAcceptServer(uvicorn_config(app, config, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    busy: list[socket.socket] = []
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n")
            busy.append(sock)
        wait_until(lambda: app.working == 4, "the app to work on all four")
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert httpx.get(f"{base}/other", timeout=5).status_code == 503
        app.release.set()
        for sock in busy:
            assert _answer(sock).startswith(b"HTTP/1.1 200 ")
        assert httpx.get(f"{base}/other", timeout=5).status_code == 200
    finally:
        app.release.set()
        for sock in busy:
            sock.close()
        server.should_exit = True
        thread.join(timeout=15)


class _BusyApp:
    """An ASGI app whose ``/work`` requests wait until ``release`` is set; anything else is
    answered at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.working = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/work":
            self.working += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


def _answer(sock: socket.socket) -> bytes:
    """One answer read off ``sock``: its head and a body of its content-length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
         if line.startswith(b"content-length:")),
        0,
    )  # fmt: skip
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _counter_in(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


EVICTED = "prefixcache_connections_evicted_total"
CLOSED_OVER_LIMIT = "prefixcache_connections_closed_over_limit_total"


def _counter(base: str, name: str) -> float:
    return _counter_in(httpx.get(f"{base}/metrics", timeout=5).text, name)


@pytest.mark.skipif(shutil.which("ss") is None, reason="reads the listening socket's queue with ss")
def test_the_kernel_queues_the_full_backlog_while_the_loop_accepts_a_batch_a_turn(
    tmp_path: Path,
) -> None:
    """asyncio accepts ``ACCEPT_BATCH`` connections a turn (its ``backlog``); the listening
    socket itself still queues ``LISTEN_BACKLOG`` (ss shows it as the socket's Send-Q)."""
    config = make_config(tmp_path, keys=False)
    app, _ = make_app(config)
    with serving(app, config) as base:
        port = base.rsplit(":", 1)[1]
        shown = subprocess.run(
            ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert ACCEPT_BATCH < LISTEN_BACKLOG
    assert int(shown[2]) == min(LISTEN_BACKLOG, somaxconn)  # State Recv-Q Send-Q Local Peer


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def test_the_budget_fits_the_connections_under_the_open_file_limit() -> None:
    server = ServerConfig(max_connections=200)
    fits = connection_budget(server, 0, (4096, 4096))
    assert (fits.max_connections, fits.warning) == (200, None)
    assert fits.max_open_connections == 200 + ACCEPT_HEADROOM
    assert fits.max_requests_per_client == 100  # half the connections by default
    assert fits.descriptors_needed == 200 + ACCEPT_HEADROOM + RESERVED_DESCRIPTORS

    lowered = connection_budget(server, 3, (NOFILE, 4096))
    usable = NOFILE - RESERVED_DESCRIPTORS - 3 * 2 - ACCEPT_HEADROOM
    assert lowered.max_connections == usable
    assert lowered.max_requests_per_client == usable // 2
    assert lowered.warning is not None
    needed = 200 + RESERVED_DESCRIPTORS + 3 * 2 + ACCEPT_HEADROOM
    assert f"ulimit -n {needed}" in lowered.warning
    assert f"lower server.max_connections to {usable}" in lowered.warning

    unlimited = connection_budget(ServerConfig(max_connections=None), 0, (NOFILE, NOFILE))
    assert unlimited.max_connections == NOFILE - RESERVED_DESCRIPTORS - ACCEPT_HEADROOM
    assert unlimited.warning is None  # nothing configured was lowered

    own = connection_budget(ServerConfig(max_requests_per_client=7), 0, None)
    assert (own.max_connections, own.max_requests_per_client) == (1000, 7)

    with pytest.raises(ConfigError, match="open-file limit is 100"):
        connection_budget(server, 0, (100, 100))


def test_max_requests_per_client_is_validated() -> None:
    def parse(value: object) -> ServerConfig:
        data = {
            "replicas": [{"name": "r", "model": "m"}],
            "server": {"max_requests_per_client": value},
        }
        return parse_config(data, "t.yaml").server

    assert parse(16).max_requests_per_client == 16
    for bad in (0, -1, 1.5, "8", True):
        with pytest.raises(ConfigError, match=r"server\.max_requests_per_client"):
            parse(bad)
