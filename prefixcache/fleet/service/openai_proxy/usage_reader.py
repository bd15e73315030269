"""The cached-token figure an engine's answer carries, read from the bytes as the proxy relays
them (nothing is held back or changed).

vLLM (``--enable-prompt-tokens-details``) and SGLang (``--enable-cache-report``) put it in
``usage.prompt_tokens_details.cached_tokens`` of OpenAI-compatible answers: a JSON answer has one
``usage``; a streamed one (``text/event-stream``) has it in its last chunk when the request asked
for ``stream_options.include_usage`` (vLLM's ``continuous_usage_stats`` repeats it on every chunk:
the last one counts). Without the flag, or without the usage chunk, there is no figure.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_JSON_BYTES = 4 << 20  # a JSON answer longer than this is relayed without being read
MAX_EVENT_BYTES = 1 << 20  # an SSE event longer than this is skipped


def cached_tokens_of(answer: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a decoded answer (None when absent)."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if type(cached) is int and cached >= 0 else None


class UsageReader:
    """Fed each relayed chunk; ``close()`` gives the figure (what passed so far is enough: a
    stream's usage chunk counts once it is whole, whatever comes after it).

    A stream costs a search or two per chunk: only the last whole event that mentions
    ``"usage"`` is kept (the last one counts), and decoded once, at ``close()``."""

    __slots__ = ("_buffer", "_last_usage", "_stream", "_too_long")

    def __init__(self, content_type: str) -> None:
        self._stream = content_type.startswith("text/event-stream")
        self._buffer = bytearray()  # a JSON answer so far, or a stream's unfinished event
        self._too_long = False
        self._last_usage: bytes | None = None  # the events (whole) where usage was last seen

    def feed(self, chunk: bytes) -> None:
        """One more chunk of the answer."""
        if not self._stream:
            if not self._too_long:
                self._buffer += chunk
                if len(self._buffer) > MAX_JSON_BYTES:
                    self._too_long = True
                    self._buffer.clear()
            return
        if self._too_long:  # inside an event too long to read: skip to its end
            end = chunk.find(b"\n\n")
            if end < 0:
                return
            self._too_long = False
            chunk = chunk[end + 2 :]
        buf = self._buffer
        data = bytes(buf) + chunk if buf else chunk
        end = data.rfind(b"\n\n")
        if end < 0:  # no event ended in it
            buf[:] = data
        else:
            if b'"usage"' in data[:end]:
                self._last_usage = data[:end]
            buf[:] = data[end + 2 :]
        if len(buf) > MAX_EVENT_BYTES:
            buf.clear()
            self._too_long = True

    def close(self) -> int | None:
        """The figure the answer carried so far (None when it carried none)."""
        if not self._stream:
            figure = None if self._too_long or not self._buffer else _figure(bytes(self._buffer))
            self._buffer.clear()
            return figure
        events = [self._last_usage or b""]
        if b'"usage"' in self._buffer and not self._too_long:  # a last event left unended
            events.append(bytes(self._buffer))
        self._buffer.clear()
        figure = None
        for event in b"\n\n".join(events).split(b"\n\n"):  # the last figure counts
            if b'"usage"' in event:
                got = _event_figure(event)
                if got is not None:
                    figure = got
        return figure


def _event_figure(event: bytes) -> int | None:
    """The figure of one server-sent event's ``data:`` lines, if any."""
    figure = None
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                got = _figure(payload)
                if got is not None:
                    figure = got
    return figure


def _figure(payload: bytes) -> int | None:
    try:
        answer = msgspec.json.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    return cached_tokens_of(answer)
