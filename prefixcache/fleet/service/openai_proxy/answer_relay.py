"""A replica's answer passed on to the client: ``whole_answer`` for one read whole (a JSON
answer), ``StreamRelay`` for an event stream, relayed chunk by chunk as it arrives.

Both keep the replica's status and headers (less the hop-by-hop ones and the framing, which the
service's own server writes), add ``x-prefixcache-replica`` and ``x-prefixcache-request-id``,
and end with ``on_close(figure)``: the engine's cached-token figure (``usage_reader``) when the
answer carried one, else None. A stream's figure is taken from its usage chunk as it passes,
so a client that closes right after ``data: [DONE]`` (the openai SDK does) loses nothing.

The relay watches the client while it waits on the replica: a client that goes away ends the
relay at once and closes the replica's connection (the engine stops the request). A replica
that breaks off mid-stream ends the stream with an error event, as vLLM ends a stream that fails
(clients raise on it; a cut-off stream would read as a short answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from prefixcache.fleet.service.openai_proxy.replica_client import UpstreamAnswer, UpstreamError
from prefixcache.fleet.service.openai_proxy.usage_reader import UsageReader

_DROPPED_HEADERS = frozenset(
    (b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"host", b"date",
     b"server")
)  # fmt: skip


def relayed_headers(
    raw: Iterable[tuple[bytes, bytes]], extra: Iterable[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """The replica's header lines to pass on, and ``extra``; names lower-cased."""
    out = [(k.lower(), v) for k, v in raw if k.lower() not in _DROPPED_HEADERS]
    out.extend(extra)
    return out


def whole_answer(
    answer: UpstreamAnswer,
    extra: Iterable[tuple[bytes, bytes]],
    on_close: Callable[[int | None], None],
    reader: UsageReader | None,
) -> Response:
    """An answer read whole, as the client's response; ``on_close`` has run."""
    body = answer.body or b""
    figure = None
    if reader is not None and answer.status == 200:
        reader.feed(body)
        figure = reader.close()
    on_close(figure)
    response = Response(status_code=answer.status)
    response.body = body
    headers = relayed_headers(answer.headers, extra)
    headers.append((b"content-length", str(len(body)).encode()))
    response.raw_headers = headers
    return response


class StreamRelay(Response):
    """An event stream relayed as it arrives; ``on_close`` runs once, however it ends."""

    def __init__(
        self,
        answer: UpstreamAnswer,
        extra: Iterable[tuple[bytes, bytes]],
        on_close: Callable[[int | None], None],
        reader: UsageReader | None,
        replica: str,
    ) -> None:
        self.status_code = answer.status
        self.background = None
        self.body = b""
        self.raw_headers = relayed_headers(answer.headers, extra)
        self._answer = answer
        self._on_close = on_close
        self._reader = reader if answer.status == 200 else None
        self._replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay until the replica's stream ends, it breaks off, or the client goes away."""

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relay = asyncio.ensure_future(self._relay(send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait((relay, watcher), return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                relay.result()  # its error, if any
        finally:
            for task in (relay, watcher):
                task.cancel()
            await asyncio.gather(relay, watcher, return_exceptions=True)
            self._answer.close()
            reader = self._reader
            self._on_close(reader.close() if reader is not None else None)

    async def _relay(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code,
             "headers": self.raw_headers}
        )  # fmt: skip
        reader = self._reader
        try:
            async for chunk in self._answer.chunks():
                if reader is not None:
                    reader.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            error = {
                "message": f"replica {self._replica} broke off the answer: {exc.kind}",
                "type": "UpstreamError",
                "code": 502,
            }
            event = b"\n\ndata: " + msgspec.json.encode({"error": error}) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
