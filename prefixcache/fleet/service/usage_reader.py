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
    """Fed each relayed chunk; ``cached_tokens`` is the figure once the answer has ended."""

    __slots__ = ("_buffer", "_stream", "_too_long", "cached_tokens")

    def __init__(self, content_type: str) -> None:
        self._stream = content_type.startswith("text/event-stream")
        self._buffer = bytearray()
        self._too_long = False
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        """One more chunk of the answer."""
        if self._too_long:
            if self._stream and b"\n\n" in chunk:  # the long event ended: read on after it
                self._too_long = False
                chunk = chunk[chunk.index(b"\n\n") + 2 :]
            else:
                return
        self._buffer += chunk
        if not self._stream:
            if len(self._buffer) > MAX_JSON_BYTES:
                self._too_long = True
                self._buffer.clear()
            return
        self._read_events()

    def _read_events(self) -> None:
        buf = self._buffer
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._read_event(bytes(buf[start:end]))
            start = end + 2
        del buf[:start]
        if len(buf) > MAX_EVENT_BYTES:
            buf.clear()
            self._too_long = True

    def _read_event(self, event: bytes) -> None:
        if b'"usage"' not in event:  # most chunks: no decoding
            return
        for line in event.split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload and payload != b"[DONE]":
                    self._take(payload)

    def _take(self, payload: bytes) -> None:
        try:
            answer = msgspec.json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return
        cached = cached_tokens_of(answer)
        if cached is not None:
            self.cached_tokens = cached

    def close(self) -> int | None:
        """The answer ended: its figure (None when it carried none)."""
        if not self._stream and not self._too_long and self._buffer:
            self._take(bytes(self._buffer))
        elif self._stream and self._buffer:
            self._buffer += b"\n\n"
            self._read_events()
        self._buffer.clear()
        return self.cached_tokens
