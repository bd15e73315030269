"""How the service listens: the uvicorn settings its ``server`` and ``tls`` sections name
(``uvicorn_options``), the head limits uvicorn lacks (``HeadTimeoutProtocol`` on h11,
``HttpToolsHeadProtocol`` on httptools), and the warning for a service open to the network
without keys (``exposure_warning``).

uvicorn bounds the keep-alive idle time (``timeout_keep_alive``) and on h11 the size of a request
head (``h11_max_incomplete_event_size``), but not the time a client takes to send its head: a
client that opens connections and trickles header bytes would hold them for good. Both protocols
here close a connection whose next request head is not complete within
``server.header_timeout_s`` of the connection opening or of its first byte. They count every
connection in the service's ``ConnectionShares`` (``guards.connection_shares``): past
``server.max_connections`` a new connection closes the partial request waiting longest of the
address holding the most, an address past its share (which tightens as the budget fills) closes
its own, and only when no connection waits on its client do requests get 503 (never a health
check: uvicorn's own ``limit_concurrency``, which answered 503 to health checks too, is off) and,
past ``max_open_connections`` (``connection_budget``: ``server.max_connections`` plus the headroom
kept for 503 answers, within the open-file limit), a new connection is closed at once, unanswered,
so that the process never runs out of descriptors. On httptools (a C parser, about a quarter
less CPU per request than h11, used when installed: ``server.http``) a head longer than
``server.max_header_bytes`` gets a 431 and the connection is closed; h11 bounds what it buffers
of an incomplete head to that size (a 400). The body has its own timeout
in the service's body reader (``FleetService.read_body``).

``BatchedAcceptServer`` is uvicorn's server accepting ``ACCEPT_BATCH`` connections a turn of the
event loop: asyncio accepts up to its ``backlog`` connections each time the listening socket is
ready, before any of them is made (and, past the ceiling, closed), so with uvicorn's 2048 a burst
larger than the free descriptors ran the process out of them, and on EMFILE asyncio stops
accepting for a second: a load balancer's health check waited that second. The kernel's queue of
connections not yet accepted keeps ``LISTEN_BACKLOG`` (the socket listens again after startup).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import ipaddress
import logging
import math
import os
import socket
from typing import Any

import msgspec
import uvicorn
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.fleet.service.configuration.access_config import ServerConfig
from prefixcache.fleet.service.configuration.config_file import ServiceConfig
from prefixcache.fleet.service.guards.connection_budget import (
    CONNECTION_EVENTS,
    ConnectionBudget,
    connection_budget,
    service_budget,
)
from prefixcache.fleet.service.guards.connection_shares import HEALTH_PATHS, ConnectionShares

_log = logging.getLogger("prefixcache.serve")

# Connections asyncio accepts a loop turn; a connection past the ceiling holds its descriptor
# for about four turns (accepted, made, closed, released), so at most 4 x 16 come on top of
# ``max_open_connections``, out of the descriptors ``RESERVED_DESCRIPTORS`` keeps.
ACCEPT_BATCH = 16
LISTEN_BACKLOG = 2048  # the kernel's queue of connections not yet accepted (uvicorn's default)


class _HeadTimeout:
    """A connection's next request head must arrive within ``head_timeout_s``: mixed into a
    uvicorn HTTP protocol, which provides ``cycle``, ``loop`` and ``transport``."""

    head_timeout_s = ServerConfig.header_timeout_s  # set per service by ``http_protocol``
    max_head_bytes = ServerConfig.max_header_bytes
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        """A new connection: its first head must arrive within the timeout."""
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Bytes of a head (or a body): a new head starts the clock; a complete one stops it."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._arm()  # between requests: these bytes start the next head
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # the head arrived: the request is served
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection ended: no timer outlives it."""
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        if self._head_timer is None:
            cycle = self.cycle
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expired, cycle)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self, cycle: Any) -> None:
        self._head_timer = None
        if self.cycle is cycle and not self.transport.is_closing():  # no new head since
            _log.info("closing a connection that sent no complete request head in time")
            self.transport.close()


class _SharedConnections:
    """Each connection counts in its service's ``ConnectionShares``, which may close another
    one (the partial request of an address holding more than its share, waiting longest) or
    this one to make room; a request on a connection past ``max_connections``, when none could
    be closed, gets 503 unless it asks for health. Mixed into a uvicorn HTTP protocol, which
    provides ``app``, ``client``, ``cycle`` and ``transport``."""

    shares: ConnectionShares | None = None  # set per service by ``http_protocol``
    app: Any
    client: tuple[str, int] | None
    cycle: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        """A new connection: counted, and room made for it (or it closed at once)."""
        super().connection_made(transport)  # type: ignore[misc]
        shares = self.shares
        if shares is None:
            return
        self._service_app, self.app = self.app, self._answer_unless_full
        victim = shares.opened(self, self.client[0] if self.client else "")
        if victim is self:
            CONNECTION_EVENTS.count_closed_over_limit()
            _log.info("closing a new connection: no room for it (server.max_connections)")
            transport.close()
        elif isinstance(victim, _SharedConnections):
            CONNECTION_EVENTS.count_evicted()
            _log.info("closing the partial request waiting longest of the address holding most")
            victim.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection ended: it no longer counts."""
        if self.shares is not None:
            self.shares.closed(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        """An answer was sent: the connection waits for its next request from now."""
        super().on_response_complete()  # type: ignore[misc]
        if self.shares is not None:
            self.shares.answered(self)

    def waiting_on_client(self) -> bool:
        """Whether its next request is incomplete: no complete head, or a body still coming."""
        if self.transport.is_closing():
            return False  # on its way out already: closing it makes no more room
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    async def _answer_unless_full(self, scope: Any, receive: Any, send: Any) -> None:
        """The service's app, or a 503 past ``max_connections`` (never to a health check)."""
        shares = self.shares
        if shares is not None and shares.over_budget and scope.get("path") not in HEALTH_PATHS:
            _log.warning("answering 503: every one of the connections served is busy")
            await service_unavailable(scope, receive, send)
            return
        await self._service_app(scope, receive, send)


class HeadTimeoutProtocol(_SharedConnections, _HeadTimeout, H11Protocol):  # type: ignore[misc]
    """uvicorn's h11 protocol with a head timeout (h11 bounds the size of a head it buffers,
    ``h11_max_incomplete_event_size``)."""


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head over ``max_head_bytes``."""


@functools.cache
def httptools_protocol() -> type[Any] | None:
    """The httptools protocol with the head limits, or None when httptools is not installed."""
    if importlib.util.find_spec("httptools") is None:
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeadProtocol(  # type: ignore[misc]
        _SharedConnections, _HeadTimeout, HttpToolsProtocol
    ):
        """uvicorn's httptools protocol with a head timeout and a head size limit: the parser's
        callbacks count the request line and header bytes of every head (pipelined ones too)
        and stop the parser past ``max_head_bytes``; the answer is a 431 and the connection is
        closed."""

        _head_bytes = 0
        _too_large = False

        def on_message_begin(self) -> None:
            """A new head: its count starts."""
            super().on_message_begin()
            self._head_bytes = 0

        def on_url(self, url: bytes) -> None:
            """Part of the request target."""
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            """One header line."""
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > self.max_head_bytes:
                self._too_large = True
                raise _HeadTooLarge  # the parser stops; uvicorn answers through send_400_response

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a parser error; a 431 when the head was too large."""
            if not self._too_large:
                super().send_400_response(msg)
                return
            message = (
                f"request head larger than {self.max_head_bytes} bytes (server.max_header_bytes)"
            )
            body = msgspec.json.encode(
                {
                    "error": {
                        "type": "RequestHeaderFieldsTooLarge",
                        "message": message,
                        "status": 431,
                    }
                }
            )
            head = (
                "HTTP/1.1 431 Request Header Fields Too Large\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            if not self.transport.is_closing():
                self.transport.write(head.encode("latin-1") + body)
                self.transport.close()

    return HttpToolsHeadProtocol


def http_protocol(server: ServerConfig, budget: ConnectionBudget | None = None) -> type[Any]:
    """The protocol class ``server.http`` names (``auto``: httptools when installed), carrying
    this service's head limits and its connection ceiling (``budget``, default: ``server``'s
    in this process); ConfigError when httptools is asked for and missing."""
    from prefixcache.errors import ConfigError

    fast = None if server.http == "h11" else httptools_protocol()
    if fast is None and server.http == "httptools":
        raise ConfigError("server.http: httptools is not installed (pip install httptools)")
    base = fast if fast is not None else HeadTimeoutProtocol
    budget = connection_budget(server) if budget is None else budget
    limits = {
        "head_timeout_s": server.header_timeout_s,
        "max_head_bytes": server.max_header_bytes,
        "shares": ConnectionShares(budget),
    }
    return type(base.__name__, (base,), limits)  # this service's limits, not every server's


def uvicorn_options(config: ServiceConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` (or ``uvicorn.Config``) that carry the limits
    and TLS of ``config``."""
    server = config.server
    budget = service_budget(config)
    return {
        "http": http_protocol(server, budget),
        "limit_concurrency": None,  # the protocol's 503, which spares health checks
        "timeout_keep_alive": max(1, math.ceil(server.keep_alive_s)),
        "h11_max_incomplete_event_size": server.max_header_bytes,
        "ssl_certfile": server.certfile,
        "ssl_keyfile": server.keyfile,
    }


def uvicorn_config(
    app: Any,
    config: ServiceConfig,
    host: str,
    port: int,
    log_level: str = "info",
    access_log: bool = True,
) -> uvicorn.Config:
    """The uvicorn settings of ``app`` with the limits and TLS of ``config``, accepting
    ``ACCEPT_BATCH`` connections a turn (serve it with ``BatchedAcceptServer``)."""
    options = uvicorn_options(config)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        backlog=ACCEPT_BATCH,
        **options,
    )


class BatchedAcceptServer(uvicorn.Server):
    """uvicorn's server whose event loop accepts ``config.backlog`` connections a turn while the
    kernel queues ``LISTEN_BACKLOG``: after startup each listening socket listens again with
    the larger queue (asyncio keeps its own count for the accept loop)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then the kernel's queue widened on every listening socket."""
        await super().startup(sockets=sockets)
        for server in getattr(self, "servers", ()):
            for listener in server.sockets:
                widened = socket.socket(fileno=os.dup(listener.fileno()))
                try:
                    widened.listen(max(LISTEN_BACKLOG, self.config.backlog))
                finally:
                    widened.close()  # the duplicate only: the listener stays open


def exposure_warning(host: str, config: ServiceConfig) -> str | None:
    """A warning when the service listens beyond this machine without API keys, else None."""
    if config.access.enabled:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"listening on {host} without API keys: anyone who can reach it can read which prompts "
        "the fleet caches and route or release requests (add auth.keys_file or auth.keys_env)"
    )
