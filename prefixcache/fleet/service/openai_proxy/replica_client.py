"""How the service talks HTTP to its replicas: a small HTTP/1.1 client on asyncio's transports and
the ``httptools`` parser (llhttp, in C), whose keep-alive connections to each replica are reused
from request to request, so a forwarded request costs one write and its answer's reads, not a
connection. It does what the proxy needs and nothing more (no redirects, cookies, compression or
proxies), at about half the time per request of a general client (aiohttp's), measured in
BENCHMARKS.md.

``ReplicaClient.post`` sends a body as it is (never re-encoded), head and body in one write, and
returns the answer once its head is in: a JSON answer read whole, an event stream
(``text/event-stream``) as chunks to relay as they come. A request that never reached the replica
raises ``NotSentError``: it may go to another replica. That is only a request whose connection
could not be made (refused, or not accepted within ``connect_timeout_s``): a pooled connection
is written to only while open, and one found closed, or idle for ``KEEP_ALIVE_S``, is dropped for
another or a new one before anything is written. Any failure after the write raises
``UpstreamError``: the replica may be running the request. Each names what went wrong
(``kind``: ``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``ReadError``,
``RemoteProtocolError``). ``get`` serves the health probes, ``post_json`` the attach probe.

Idle connections are dropped after ``KEEP_ALIVE_S``, before a replica's server closes them on its
side (uvicorn's default, vLLM's and SGLang's, is 5 s), so a request is seldom written to a
connection the replica is closing. Nothing is added to a request but ``Host`` and
``Content-Length``: no compression is asked for, and an answer's body is relayed as the replica
sent it (chunked framing removed; the service's server frames it again).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

import httptools
import msgspec

KEEP_ALIVE_S = 4.0  # below the 5 s idle time after which uvicorn-served engines close
MAX_BUFFERED_BYTES = 1 << 20  # a streamed answer's unread bytes before its reads pause
_KNOWN_URLS = 4096  # parsed URLs kept (one per replica and path, in practice)


class UpstreamError(Exception):
    """A request to a replica failed after it may have reached it; ``kind`` names how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class NotSentError(UpstreamError):
    """The request never reached the replica: its connection was refused or not accepted in
    time."""


class _Target(NamedTuple):
    """A URL as the client uses it: the pool it draws from, where to connect, and the request
    line's path and ``Host``."""

    pool: tuple[str, str, int]  # scheme, host, port
    host: str
    port: int
    tls: bool
    path: bytes
    host_header: bytes


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError("ConnectError", f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _Target(
        (parts.scheme, parts.hostname, port),
        parts.hostname,
        port,
        tls,
        path.encode("ascii"),
        parts.netloc.rsplit("@", 1)[-1].encode("ascii"),
    )


def _head(method: bytes, target: _Target, headers: Mapping[str, str], length: int) -> bytes:
    """The request's head: request line, ``Host``, ``headers``, ``Content-Length``."""
    lines = [method, b" ", target.path, b" HTTP/1.1\r\nHost: ", target.host_header, b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise UpstreamError("InvalidHeader", f"header {name!r} has a line break or a colon")
        lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    lines.append(b"content-length: %d\r\n\r\n" % length)
    return b"".join(lines)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one exchange at a time, its answer parsed as bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False  # lost, or closed by us: never written to again
        self.idle_since = 0.0
        self.busy = False  # an exchange is on
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False  # the answer's end was read
        self.keep_alive = False  # the replica keeps the connection open after this answer
        self.framed = False  # the answer's length is known (Content-Length or chunked)
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.pause_at = 0  # buffered bytes that pause reading (0: never, the body is read whole)
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("RemoteProtocolError", f"not an HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        self.closed = True
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.busy or self.done:
            return
        if self.head_done and not self.framed and exc is None:
            self.done = True  # an answer that ends with its connection
            self._wake()
        elif exc is None:
            self._fail(UpstreamError("RemoteProtocolError", "the replica closed the connection"))
        else:
            self._fail(UpstreamError("ReadError", str(exc) or type(exc).__name__))

    # the parser's side
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.pause_at and self.buffered > self.pause_at and not self.paused:
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser resets next
        self._wake()

    # the client's side
    def start(self, request: bytes) -> None:
        """Send ``request`` (head and body): the connection's next exchange begins."""
        assert self.transport is not None and not self.closed and not self.busy
        self.busy = True
        self.status, self.headers = 0, []
        self.head_done = self.done = self.framed = self.keep_alive = False
        self.chunks.clear()
        self.buffered = 0
        self.pause_at = 0
        self.error = None
        self.transport.write(request)

    async def wait(self, timeout_s: float) -> None:
        """Until something more of the answer arrived (or it failed); ReadTimeout after
        ``timeout_s`` without a byte."""
        if self.error is not None:
            raise self.error
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, self._timed_out, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def take(self) -> bytes:
        """The body's bytes read so far and not yet taken."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly and the replica keeps the connection open."""
        return (
            self.done
            and self.error is None
            and not self.closed
            and self.keep_alive
            and not self.chunks
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _timed_out(self, waiter: asyncio.Future[None], timeout_s: float) -> None:
        if waiter is self._waiter and not waiter.done():
            self._fail(UpstreamError("ReadTimeout", f"no answer within {timeout_s:g} s"))
            self.close()


class UpstreamAnswer:
    """A replica's answer whose head is in: ``status``, ``headers`` (as sent), and either its
    whole ``body`` (None for an event stream) or ``chunks()``; ``close()`` once done with it
    (a stream not read to its end closes its connection)."""

    __slots__ = ("_client", "_conn", "_pool", "_timeout_s", "body", "headers", "status", "streamed")

    def __init__(
        self,
        client: ReplicaClient,
        conn: _Connection,
        pool: tuple[str, str, int],
        body: bytes | None,
        timeout_s: float,
    ) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._pool = pool
        self._timeout_s = timeout_s
        self.status = conn.status
        self.headers = conn.headers
        self.body = body
        self.streamed = body is None

    @property
    def content_type(self) -> str:
        return _content_type(self.headers)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; UpstreamError if the replica breaks off (or sends
        nothing for the client's timeout)."""
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.error is not None:
                raise conn.error
            elif conn.done:
                return
            else:
                await conn.wait(self._timeout_s)

    def close(self) -> None:
        """Done with it: the connection goes back to the pool when the answer was read to its
        end, else it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._release(self._pool, conn)


def _content_type(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.decode("latin-1")
    return ""


class ReplicaClient:
    """The pooled client, ``close``d with the service (a later request opens connections
    again). ``timeout_s``: the longest wait for any read (the answer's head, or its next
    bytes); ``connect_timeout_s``: for a connection to be accepted."""

    def __init__(self, timeout_s: float, connect_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tls: ssl.SSLContext | None = None

    async def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        """POST ``body`` to ``url``: the answer, read whole unless it is an event stream.
        NotSentError when it never reached the replica, UpstreamError for a later failure."""
        return await self._exchange(b"POST", url, body, headers, self.timeout_s)

    async def post_json(self, url: str, payload: Any) -> tuple[int, bytes]:
        """POST ``payload`` as JSON: the status and the body. UpstreamError on failure."""
        headers = {"content-type": "application/json"}
        answer = await self.post(url, msgspec.json.encode(payload), headers)
        if answer.body is None:  # a stream: read it all
            try:
                parts = [chunk async for chunk in answer.chunks()]
            finally:
                answer.close()
            return answer.status, b"".join(parts)
        return answer.status, answer.body

    async def get(self, url: str, timeout_s: float) -> int:
        """GET ``url`` within ``timeout_s`` in all: its status. UpstreamError on failure."""
        deadline = time.monotonic() + timeout_s
        task = self._exchange(b"GET", url, b"", {}, timeout_s, deadline, whole=True)
        try:
            answer = await asyncio.wait_for(task, timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError("ReadTimeout", f"no answer within {timeout_s:g} s") from None
        return answer.status

    async def _exchange(
        self,
        method: bytes,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
        deadline: float | None = None,
        *,
        whole: bool = False,
    ) -> UpstreamAnswer:
        """One request and its answer's head (and its body unless it streams and not
        ``whole``)."""
        target = self._targets.get(url)
        if target is None:
            target = _target(url)
            if len(self._targets) >= _KNOWN_URLS:
                self._targets.clear()
            self._targets[url] = target
        request = _head(method, target, headers, len(body)) + body
        conn = self._pooled(target.pool) or await self._connect(target, deadline)
        conn.start(request)  # from here on, the replica may have the request
        answered = False
        try:
            while not conn.head_done:
                await conn.wait(timeout_s)
            streamed = not whole and _content_type(conn.headers).startswith("text/event-stream")
            if streamed:
                conn.pause_at = MAX_BUFFERED_BYTES
                answer = UpstreamAnswer(self, conn, target.pool, None, timeout_s)
            else:
                while not conn.done:
                    await conn.wait(timeout_s)
                data = conn.take()
                answer = UpstreamAnswer(self, conn, target.pool, data, timeout_s)
                answer.close()
            answered = True
            return answer
        finally:
            if not answered:  # failed or cancelled mid-answer: the connection is done for
                conn.close()

    def _pooled(self, pool: tuple[str, str, int]) -> _Connection | None:
        """An idle connection to ``pool`` still open and idle for less than ``KEEP_ALIVE_S``
        (the most recently used first), or None; the others are closed."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop they were made on
            self._idle = {}
            self._loop = loop
        conns = self._idle.get(pool)
        if not conns:
            return None
        oldest = time.monotonic() - KEEP_ALIVE_S
        while conns:
            conn = conns.pop()
            if not conn.closed and conn.idle_since > oldest:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target, deadline: float | None) -> _Connection:
        """A new connection to ``target``; NotSentError when it cannot be made in time."""
        loop = asyncio.get_running_loop()
        timeout_s = self.connect_timeout_s
        if deadline is not None:
            timeout_s = max(0.0, min(timeout_s, deadline - time.monotonic()))
        tls = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop), target.host, target.port, ssl=tls
                ),
                timeout_s,
            )
        except asyncio.TimeoutError:
            where = f"{target.host}:{target.port}"
            detail = f"{where} did not accept within {timeout_s:g} s"
            raise NotSentError("ConnectTimeout", detail) from None
        except OSError as exc:
            raise NotSentError("ConnectError", str(exc) or type(exc).__name__) from None
        return conn

    def _release(self, pool: tuple[str, str, int], conn: _Connection) -> None:
        """An exchange is over: its connection back to the pool if it can take another."""
        conn.busy = False
        if not conn.reusable():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conns = self._idle.get(pool)
        if conns is None:
            conns = self._idle[pool] = []
        conns.append(conn)
