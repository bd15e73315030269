"""What clients can write into the service's log: a thousand requests whose clients disconnect
in the middle of the body leave no line (they are counted in ``prefixcache_aborted_requests``),
and a flood of malformed requests leaves one line with a count (``prefixcache serve`` in a
subprocess, raw sockets). The pieces on their own: the repeat filter, and the event loop's
exception handler when accept() runs out of descriptors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from starlette.requests import ClientDisconnect

from prefixcache.fleet.service.guards.connection_budget import ConnectionEvents
from prefixcache.fleet.service.guards.quiet_log import (
    ACCEPT_FAILED,
    QuietExceptionHandler,
    RepeatFilter,
)
from tests.fleet.fleet_processes import running
from tests.fleet_support import free_port, wait_until

ABORTED = 1000
AT_ONCE = 25  # aborted requests open together
MALFORMED = 300
HANDFUL = 5


@contextlib.contextmanager
def _service(tmp_path: Path) -> Iterator[str]:
    config = {
        "index": "memory",
        "health": {"probe_interval_s": None},
        "replicas": [{"name": "r1", "model": "m", "block_size": 4}],
    }
    (tmp_path / "fleet.yaml").write_text(json.dumps(config))
    port = free_port()
    args = ["prefixcache", "serve", "--config", str(tmp_path / "fleet.yaml"), "--port", str(port)]
    with running(args, port, tmp_path / "service.log") as base:
        yield base


def _send_and_close(
    base: str, n: int, data: bytes, settled: Callable[[int], bool] = lambda sent: True
) -> None:
    """``n`` connections that each send ``data`` and close, ``AT_ONCE`` open together; the
    next ones once ``settled(sent so far)`` (so that they never pile up past the service's
    connection limit, which would answer 503 before any body is read)."""
    port = int(base.rsplit(":", 1)[1])
    for start in range(0, n, AT_ONCE):
        socks = [
            socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(min(AT_ONCE, n - start))
        ]
        for sock in socks:
            sock.sendall(data)
        for sock in socks:
            sock.close()
        sent = start + len(socks)
        wait_until(lambda n=sent: settled(n), f"{sent} requests settled", 30)


def _metric(base: str, line_start: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _lines(log: Path, since: int) -> list[str]:
    return log.read_bytes()[since:].decode().splitlines()


def test_aborted_bodies_are_counted_not_logged_and_bad_requests_are_rate_limited(
    tmp_path: Path,
) -> None:
    log = tmp_path / "service.log"
    with _service(tmp_path) as base:
        before = log.stat().st_size
        head = (
            "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 50\r\n\r\n"
        )
        aborted = 'prefixcache_aborted_requests_total{endpoint="/v1/route"}'
        body = b'{"model": "m"'  # 13 of 50 bytes
        _send_and_close(
            base, ABORTED, head.encode() + body, lambda sent: _metric(base, aborted) == sent
        )
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        after_aborts = _lines(log, before)
        assert len(after_aborts) <= HANDFUL, after_aborts

        middle = log.stat().st_size
        _send_and_close(base, MALFORMED, b"NOT HTTP AT ALL\r\n\r\n")
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        after_malformed = _lines(log, middle)
    written = _lines(log, middle)  # the service stopped: what it held back is written now
    assert len(after_malformed) <= HANDFUL, after_malformed
    assert len(written) <= 2 * HANDFUL, written
    invalid = [line for line in written if "Invalid HTTP request" in line]
    assert invalid and any(f"{MALFORMED - 1} more like" in line for line in invalid), written
    assert "Traceback" not in log.read_text()


def _record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, (), exc_info)


def test_the_repeat_filter_writes_a_template_once_per_window_with_the_count() -> None:
    now = [0.0]
    repeat = RepeatFilter(window_s=10.0, clock=lambda: now[0])
    assert repeat.filter(_record("Exceeded concurrency limit."))
    assert not any(repeat.filter(_record("Exceeded concurrency limit.")) for _ in range(999))
    assert repeat.filter(_record("another line"))  # another template is its own
    assert repeat.left_out() == {("uvicorn.error", "Exceeded concurrency limit."): 999}
    now[0] = 10.0
    again = _record("Exceeded concurrency limit.")
    assert repeat.filter(again)
    assert "[999 more like this in the 10 s before]" in again.getMessage()
    assert repeat.left_out() == {}

    # what a client causes keeps one line and loses its traceback
    cut = _record("Exception in ASGI application\n", ClientDisconnect())
    assert repeat.filter(cut)
    assert cut.exc_info is None and "ClientDisconnect" in cut.getMessage()
    bug = _record("Exception in ASGI application (a bug)", ValueError("x"))
    assert repeat.filter(bug) and bug.exc_info is not None  # a bug keeps its traceback


def test_accept_out_of_descriptors_is_counted_and_written_once() -> None:
    events = ConnectionEvents()
    handler = QuietExceptionHandler(events)
    loop = asyncio.new_event_loop()
    repeat = RepeatFilter()
    serve_log = logging.getLogger("prefixcache.serve")
    written: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            written.append(record)

    keep = Keep()
    serve_log.addFilter(repeat)
    serve_log.addHandler(keep)
    try:
        for _ in range(2048):  # asyncio calls it once per pending connection of the backlog
            exc = OSError(errno.EMFILE, "Too many open files")
            handler(loop, {"message": ACCEPT_FAILED, "exception": exc})
    finally:
        serve_log.removeFilter(repeat)
        serve_log.removeHandler(keep)
        loop.close()
    assert events.accept_failures == 2048
    assert len(written) == 1 and written[0].exc_info is None
    assert "ulimit -n" in written[0].getMessage()
