"""The service's log under hostile clients: what a client can cause is a count, not a traceback,
and a repeated line is written once per ``REPEAT_WINDOW_S`` with how many were left out.

- ``RepeatFilter`` (on the loggers clients can reach, ``QUIET_LOGGERS``): a record whose
  logger and message template were written less than ``REPEAT_WINDOW_S`` ago is dropped and
  counted; the next one written says how many were dropped before it, and whatever is still
  counted when the service stops is written then. A record of an exception a client causes (a
  connection reset, a body cut off) loses its traceback and keeps one line.
- ``QuietExceptionHandler`` (the event loop's exception handler): an ``accept()`` that failed
  for lack of descriptors (asyncio calls the handler once per pending connection, up to the
  listen backlog, then stops accepting for a second) is counted in
  ``ConnectionEvents.accept_failures`` and logged as one line naming what to raise; a client's
  failed connection is one line; anything else goes to asyncio's own handler, through the
  filter.

``quiet_service_logs`` installs both for the service's lifetime (``app._lifespan``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect

from prefixcache.fleet.service.guards.connection_budget import CONNECTION_EVENTS, ConnectionEvents

REPEAT_WINDOW_S = 10.0
QUIET_LOGGERS = ("uvicorn.error", "asyncio", "prefixcache.serve")
MAX_TEMPLATES = 1024  # templates remembered at once; past it, the stale ones are forgotten
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message
RESOURCE_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
CLIENT_CAUSED = (ClientDisconnect, ConnectionError, ssl.SSLError)

_log = logging.getLogger("prefixcache.serve")


class RepeatFilter(logging.Filter):
    """Writes each (logger, message template) at most once per ``window_s``, with the count of
    those left out since; client-caused exceptions lose their tracebacks."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        # (logger name, template) -> [when last written, records left out since]
        self._last: dict[tuple[str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a repeat within the window; else True, the record told how many repeats
        were left out before it."""
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.window_s:
                last[1] += 1
                return False
            left_out = int(last[1]) if last is not None else 0
            if last is None and len(self._last) >= MAX_TEMPLATES:
                self._forget_stale(now)
            self._last[key] = [now, 0]
        _strip_client_traceback(record)
        if left_out:
            record.msg = (
                f"{record.msg} [{left_out} more like this in the {self.window_s:g} s before]"
            )
        return True

    def left_out(self) -> dict[tuple[str, str], int]:
        """The records dropped and not yet told of, per (logger name, template)."""
        with self._lock:
            return {key: int(last[1]) for key, last in self._last.items() if last[1]}

    def flush(self) -> None:
        """Write one line per template with records dropped and not yet told of."""
        for (name, template), count in self.left_out().items():
            logging.getLogger(name).warning(
                "%d more like %r in the last %g s", count, template.strip(), self.window_s
            )

    def _forget_stale(self, now: float) -> None:
        stale = [k for k, last in self._last.items() if now - last[0] >= self.window_s]
        for key in stale or list(self._last)[: MAX_TEMPLATES // 2]:
            del self._last[key]


def _strip_client_traceback(record: logging.LogRecord) -> None:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, CLIENT_CAUSED):
        record.exc_info = None
        record.exc_text = None
        record.msg = f"{str(record.msg).rstrip()} ({type(exc).__name__}: a client went away)"


class QuietExceptionHandler:
    """The event loop's exception handler while the service runs (see the module docstring)."""

    def __init__(self, events: ConnectionEvents = CONNECTION_EVENTS) -> None:
        self.events = events

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == ACCEPT_FAILED or (
            isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and "accept" in str(context)
        ):
            self.events.count_accept_failure()
            _log.warning(
                "cannot accept connections (%s): retrying in a second; raise the open-file limit "
                "(ulimit -n) or lower server.max_connections",
                exc,
            )
            return
        if isinstance(exc, CLIENT_CAUSED):
            _log.info("a client connection failed: %s: %s", type(exc).__name__, exc)
            return
        loop.default_exception_handler(context)


def quiet_service_logs(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Install the filter on ``QUIET_LOGGERS`` and the exception handler on ``loop``; the
    function that removes them again (writing what the filter still holds back)."""
    repeat = RepeatFilter()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).addFilter(repeat)
    previous = loop.get_exception_handler()
    loop.set_exception_handler(QuietExceptionHandler())

    def restore() -> None:
        loop.set_exception_handler(previous)
        for name in QUIET_LOGGERS:
            logging.getLogger(name).removeFilter(repeat)
        repeat.flush()

    return restore
