"""How the service listens: the uvicorn settings its ``server`` and ``tls`` sections name
(``uvicorn_options``), a head read timeout uvicorn lacks (``HeadTimeoutProtocol``), and the warning
for a service open to the network without keys (``exposure_warning``).

uvicorn bounds the keep-alive idle time (``timeout_keep_alive``), the size of a request head
(``h11_max_incomplete_event_size``) and the connections it serves (``limit_concurrency``: past
it, new requests get a 503), but not the time a client takes to send its head: a client that
opens connections and trickles header bytes would hold them for good. ``HeadTimeoutProtocol``
closes a connection whose next request head is not complete within ``server.header_timeout_s``
of the connection opening or of its first byte; the body has its own timeout in the service's
body reader (``FleetService.read_body``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.fleet.service.access_settings import ServerConfig
from prefixcache.fleet.service.settings import ServiceConfig

_log = logging.getLogger("prefixcache.serve")


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections that do not send a request head in time."""

    head_timeout_s = ServerConfig.header_timeout_s  # set per service by ``uvicorn_config``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first head must arrive within the timeout."""
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Bytes of a head (or a body): a new head starts the clock; a complete one stops it."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._arm()  # between requests: these bytes start the next head
        super().data_received(data)
        if self.cycle is not cycle:  # the head arrived: the request is served
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection ended: no timer outlives it."""
        self._disarm()
        super().connection_lost(exc)

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


def uvicorn_options(config: ServiceConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` (or ``uvicorn.Config``) that carry the limits
    and TLS of ``config``."""
    server = config.server

    class Protocol(HeadTimeoutProtocol):  # this service's timeout, not every server's
        head_timeout_s = server.header_timeout_s

    return {
        "http": Protocol,
        "limit_concurrency": server.max_connections,
        "timeout_keep_alive": max(1, math.ceil(server.keep_alive_s)),
        "h11_max_incomplete_event_size": server.max_header_bytes,
        "ssl_certfile": server.certfile,
        "ssl_keyfile": server.keyfile,
    }


def uvicorn_config(
    app: Any, config: ServiceConfig, host: str, port: int, log_level: str = "info"
) -> uvicorn.Config:
    """The uvicorn settings of ``app`` with the limits and TLS of ``config``."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, **uvicorn_options(config))


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
