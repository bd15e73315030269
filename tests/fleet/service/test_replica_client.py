"""The replicas' HTTP client against real sockets on 127.0.0.1 (asyncio servers written byte by
byte, so that each way an upstream can fail is exact):

- a request that cannot have reached the replica (refused, not accepted in time) is
  ``NotSentError``; one whose bytes were written is ``UpstreamError`` whatever happens next
  (closed without an answer, reset, silent past the timeout);
- a pooled connection the replica closed while it sat idle is never written to: the request goes
  on a new connection, and the replica reads it once;
- answers: a JSON answer whole (by Content-Length, chunked, or ended with the connection), an
  event stream as its chunks arrive, the connection reused after an answer read to its end and
  closed after one left unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from prefixcache.fleet.service.openai_proxy import replica_client
from prefixcache.fleet.service.openai_proxy.replica_client import (
    NotSentError,
    ReplicaClient,
    UpstreamError,
)

JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
Handler = Callable[["Upstream", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request, head and body (by its Content-Length); b"" when the peer closed first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def json_answer(body: bytes) -> bytes:
    return JSON_HEAD + b"content-length: %d\r\n\r\n" % len(body) + body


class Upstream:
    """An asyncio server on 127.0.0.1 whose ``handler`` serves each connection; it counts
    connections and keeps the requests read (``requests``)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.go = asyncio.Event()  # a handler's signal, where it waits for the client
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await self.handler(self, reader, writer)

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        request = await read_request(reader)
        if request:
            self.requests.append(request)
        return request


@contextlib.asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[Upstream]:
    up = Upstream(handler)
    server = await asyncio.start_server(up._serve, "127.0.0.1", 0)
    up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield up
    finally:
        server.close()
        for writer in up.writers:
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def keep_answering(up: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         body: bytes = b'{"ok": 1}') -> None:  # fmt: skip
    """Answer every request on the connection with ``body`` (keep-alive)."""
    while await up.read(reader):
        writer.write(json_answer(body))
        await writer.drain()


def run(coro: Awaitable[object]) -> object:
    async def main() -> object:
        return await asyncio.wait_for(coro, 30)  # a hang fails the test, never blocks it

    return asyncio.run(main())


def test_a_refused_connection_is_not_sent() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> None:
        client = ReplicaClient(5.0, 5.0)
        with pytest.raises(NotSentError) as refused:
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
        assert refused.value.kind == "ConnectError"
        await client.close()

    run(go())


def test_a_connection_not_accepted_in_time_is_not_sent() -> None:
    async def go() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # a full backlog: the kernel leaves further handshakes unanswered
        address = listener.getsockname()
        waiting = []
        with contextlib.suppress(OSError):
            for _ in range(8):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(address)
                waiting.append(s)
        client = ReplicaClient(5.0, 0.3)
        try:
            with pytest.raises(NotSentError) as late:
                await client.post(f"http://{address[0]}:{address[1]}/v1/completions", b"{}", {})
            assert late.value.kind == "ConnectTimeout"
        finally:
            await client.close()
            for s in waiting:
                s.close()
            listener.close()

    run(go())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_request_written_and_met_by_a_closed_connection_is_an_upstream_error(how: str) -> None:
    async def swallow(up: Upstream, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:  # fmt: skip
        await up.read(reader)
        if how == "reset":  # RST instead of FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    async def go() -> None:
        async with upstream(swallow) as up:
            client = ReplicaClient(5.0, 5.0)
            with pytest.raises(UpstreamError) as failed:
                await client.post(f"{up.url}/v1/completions", b'{"p": 1}', {})
            assert not isinstance(failed.value, NotSentError)  # it may be running: never again
            assert failed.value.kind == ("RemoteProtocolError" if how == "close" else "ReadError")
            assert len(up.requests) == 1
            await client.close()

    run(go())


def test_a_replica_silent_past_the_timeout_is_a_read_timeout_and_its_connection_dropped() -> None:
    async def stall_first(up: Upstream, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:  # fmt: skip
        if up.connections == 1:
            await up.read(reader)
            writer.write(JSON_HEAD + b"content-length: 10\r\n\r\n{")  # then nothing more
            await reader.read()  # until the client gives up on the connection
            return
        await keep_answering(up, reader, writer)

    async def go() -> None:
        async with upstream(stall_first) as up:
            client = ReplicaClient(0.3, 5.0)
            with pytest.raises(UpstreamError) as late:
                await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert late.value.kind == "ReadTimeout" and not isinstance(late.value, NotSentError)
            answer = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert answer.status == 200 and answer.body == b'{"ok": 1}'
            assert up.connections == 2  # the timed-out connection was not used again
            await client.close()

    run(go())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_pooled_connection_the_replica_closed_is_never_written_to(how: str) -> None:
    async def answer_once(up: Upstream, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:  # fmt: skip
        await up.read(reader)
        writer.write(json_answer(b'{"n": %d}' % up.connections))
        await writer.drain()
        if how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # idle: the replica closes its side, as servers do after a while

    async def go() -> None:
        async with upstream(answer_once) as up:
            client = ReplicaClient(5.0, 5.0)
            first = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert first.body == b'{"n": 1}'
            for _ in range(100):  # the close reaches the client's side of the pooled connection
                await asyncio.sleep(0.01)
                if all(c.closed for conns in client._idle.values() for c in conns):
                    break
            second = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert second.status == 200 and second.body == b'{"n": 2}'
            assert len(up.requests) == 2 and up.connections == 2
            await client.close()

    run(go())


def test_keep_alive_reuses_one_connection_and_drops_it_once_idle_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> None:
        async with upstream(keep_answering) as up:
            client = ReplicaClient(5.0, 5.0)
            for _ in range(5):
                answer = await client.post(f"{up.url}/v1/completions", b"{}", {"x-a": "1"})
                assert answer.status == 200
            assert up.connections == 1
            monkeypatch.setattr(replica_client, "KEEP_ALIVE_S", 0.0)  # every idle one too old
            await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert up.connections == 2
            await client.close()

    run(go())


def test_the_request_goes_as_given_with_host_and_length() -> None:
    async def go() -> None:
        async with upstream(keep_answering) as up:
            client = ReplicaClient(5.0, 5.0)
            body = b'{"prompt": "caf\xc3\xa9"}'
            headers = {"content-type": "application/json", "authorization": "Bearer k"}
            await client.post(f"{up.url}/base/v1/completions?x=1", body, headers)
            head, sent = up.requests[0].split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /base/v1/completions?x=1 HTTP/1.1"
            assert sorted(lines[1:]) == sorted([
                b"Host: " + up.url.removeprefix("http://").encode(),
                b"content-type: application/json",
                b"authorization: Bearer k",
                b"content-length: %d" % len(body),
            ])  # fmt: skip
            assert sent == body
            with pytest.raises(UpstreamError) as bad:  # a header that would split the head
                await client.post(f"{up.url}/v1/completions", b"{}", {"x-a": "1\r\nx-b: 2"})
            assert bad.value.kind == "InvalidHeader" and len(up.requests) == 1
            await client.close()

    run(go())


def test_json_answers_by_length_chunked_and_until_the_connection_ends() -> None:
    async def framings(up: Upstream, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:  # fmt: skip
        while request := await up.read(reader):
            if b"/chunked" in request:
                writer.write(JSON_HEAD + b"transfer-encoding: chunked\r\n\r\n")
                for part in (b'{"a": ', b"[1, 2]", b"}"):
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            elif b"/eof" in request:
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 70_000)
                await writer.drain()
                writer.close()
                return
            else:
                writer.write(json_answer(b'{"a": [1, 2]}'))
            await writer.drain()

    async def go() -> None:
        async with upstream(framings) as up:
            client = ReplicaClient(5.0, 5.0)
            for path in ("/length", "/chunked", "/length"):
                answer = await client.post(f"{up.url}{path}", b"{}", {})
                assert (answer.status, answer.body, answer.streamed) == (
                    200,
                    b'{"a": [1, 2]}',
                    False,
                )
                assert answer.content_type == "application/json"
            assert up.connections == 1
            ended = await client.post(f"{up.url}/eof", b"{}", {})
            assert ended.body == b"x" * 70_000
            assert await client.get(f"{up.url}/length", 5.0) == 200
            assert up.connections == 2
            await client.close()

    run(go())


def test_an_event_stream_comes_as_it_is_sent() -> None:
    sent = [b'data: {"i": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]

    async def stream(up: Upstream, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        while await up.read(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            for event in sent:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await up.go.wait()  # the next event once the client has read this one
                up.go.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def go() -> None:
        async with upstream(stream) as up:
            client = ReplicaClient(5.0, 5.0)
            answer = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert answer.streamed and answer.body is None
            assert answer.content_type == "text/event-stream"
            got = []
            async for chunk in answer.chunks():
                got.append(chunk)
                up.go.set()
            answer.close()
            assert got == sent
            # read to its end: the connection serves the next request; one left unread is closed
            left = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert up.connections == 1
            left.close()
            up.go.set()
            again = await client.post(f"{up.url}/v1/completions", b"{}", {})
            assert up.connections == 2
            again.close()
            await client.close()

    run(go())


def test_a_stream_broken_off_raises_after_what_came() -> None:
    async def broken(up: Upstream, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        await up.read(reader)
        event = b"data: {}\n\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        writer.write(head + b"\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.close()

    async def go() -> None:
        async with upstream(broken) as up:
            client = ReplicaClient(5.0, 5.0)
            answer = await client.post(f"{up.url}/v1/completions", b"{}", {})
            got = []
            with pytest.raises(UpstreamError) as cut:
                async for chunk in answer.chunks():
                    got.append(chunk)
            answer.close()
            assert got == [b"data: {}\n\n"] and cut.value.kind == "RemoteProtocolError"
            await client.close()

    run(go())


def test_get_gives_up_within_its_time() -> None:
    async def silent(up: Upstream, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        await up.read(reader)
        await reader.read()

    async def go() -> None:
        async with upstream(silent) as up:
            client = ReplicaClient(60.0, 60.0)
            with pytest.raises(UpstreamError) as late:
                await client.get(f"{up.url}/health", 0.3)
            assert late.value.kind == "ReadTimeout"
            await client.close()

    run(go())


def test_the_client_runs_on_uvloop() -> None:
    """uvicorn runs the service on uvloop where it is installed (``uvicorn[standard]``), whose
    transports are not ``asyncio.Transport`` subclasses."""
    uvloop = pytest.importorskip("uvloop")

    async def go() -> None:
        async with upstream(keep_answering) as up:
            client = ReplicaClient(5.0, 5.0)
            for _ in range(3):
                answer = await client.post(f"{up.url}/v1/completions", b"{}", {})
                assert (answer.status, answer.body) == (200, b'{"ok": 1}')
            assert up.connections == 1
            await client.close()

    uvloop.run(asyncio.wait_for(go(), 30))
