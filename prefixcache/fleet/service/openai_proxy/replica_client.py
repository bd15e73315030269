"""How the service talks HTTP to its replicas: one pooled HTTP/1.1 client (aiohttp, its C
parser) whose keep-alive connections to each replica are reused from request to request, so a
forwarded request costs one write and its answer's reads, not a connection.

``ReplicaClient.post`` sends a body as it is (never re-encoded) and returns the answer once its
head is in: a JSON answer read whole, an event stream (``text/event-stream``) as chunks to relay
as they come. A request that never reached the replica (the connection refused, or not accepted
within ``connect_timeout_s``) raises ``NotSentError``: it may go to another replica. Any later
failure raises ``UpstreamError``: the replica may be running the request. Each names what went
wrong in the service's own words (``kind``: ``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``ReadError``, ``RemoteProtocolError``), whatever the library says. ``get`` serves the health
probes, ``post_json`` the attach probe.

Idle connections are closed after ``KEEP_ALIVE_S``, before a replica's server closes them on its
side (uvicorn's default, vLLM's and SGLang's, is 5 s), so a request is seldom written to a
connection the replica is closing. Nothing is added to a request but its head: no compression is
asked for, and an answer's body is relayed as the replica sent it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import msgspec

KEEP_ALIVE_S = 4.0  # below the 5 s idle time after which uvicorn-served engines close
_NO_AUTO_HEADERS = frozenset(("Accept-Encoding", "User-Agent", "Content-Type"))


class UpstreamError(Exception):
    """A request to a replica failed after it may have reached it; ``kind`` names how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class NotSentError(UpstreamError):
    """The request never reached the replica: its connection was refused or not accepted in
    time."""


def _failure(exc: BaseException) -> UpstreamError:
    """The service's error for an exception of the HTTP library (or of asyncio)."""
    detail = str(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return NotSentError("ConnectTimeout", detail)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return NotSentError("ConnectError", detail)
    if isinstance(exc, aiohttp.SocketTimeoutError | asyncio.TimeoutError):
        return UpstreamError("ReadTimeout", detail or "no answer in time")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return UpstreamError("RemoteProtocolError", detail)
    return UpstreamError("ReadError", detail or type(exc).__name__)


class UpstreamAnswer:
    """A replica's answer whose head is in: ``status``, ``headers`` (as sent), and either its
    whole ``body`` (None for an event stream) or ``chunks()``; ``close()`` once done with it
    (a stream not read to its end closes its connection)."""

    __slots__ = ("_response", "body", "headers", "status", "streamed")

    def __init__(self, response: aiohttp.ClientResponse, body: bytes | None) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.raw_headers
        self.body = body
        self.streamed = body is None

    @property
    def content_type(self) -> str:
        return self._response.headers.get("Content-Type", "")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; UpstreamError if the replica breaks off."""
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _failure(exc) from None

    def close(self) -> None:
        """Done with it: the connection goes back to the pool when the answer was read to its
        end, else it is closed."""
        self._response.release() if self._response.content.at_eof() else self._response.close()


class ReplicaClient:
    """The pooled client, opened at its first request, ``close``d with the service.
    ``timeout_s``: the longest wait for any read (the answer's head, or its next bytes)."""

    def __init__(self, timeout_s: float, connect_timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session and its connection pool, opened at first use (on the event loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0,  # as many connections as requests in flight
                keepalive_timeout=KEEP_ALIVE_S,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self.timeout,
                auto_decompress=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
                raise_for_status=False,
            )
        return self._session

    async def close(self) -> None:
        """Close every connection (a later request opens the pool again)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        """POST ``body`` to ``url``: the answer, read whole unless it is an event stream.
        NotSentError when it never reached the replica, UpstreamError for a later failure."""
        try:
            response = await self.session.post(url, data=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _failure(exc) from None
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            return UpstreamAnswer(response, None)
        try:
            data = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            response.close()
            raise _failure(exc) from None
        response.release()
        return UpstreamAnswer(response, data)

    async def post_json(self, url: str, payload: Any) -> tuple[int, bytes]:
        """POST ``payload`` as JSON: the status and the body. UpstreamError on failure."""
        headers = {"content-type": "application/json"}
        answer = await self.post(url, msgspec.json.encode(payload), headers)
        if answer.body is None:  # a stream: read it all
            parts = [chunk async for chunk in answer.chunks()]
            answer.close()
            return answer.status, b"".join(parts)
        return answer.status, answer.body

    async def get(self, url: str, timeout_s: float) -> int:
        """GET ``url`` within ``timeout_s`` in all: its status. UpstreamError on failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.get(url, timeout=timeout) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _failure(exc) from None
