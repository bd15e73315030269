"""The service of one process from a config file and the command's options (``open_service``:
the config with ``--index``, ``--proxy`` and ``--record-trace`` applied, then
``assembly.build_service``), and what ``prefixcache serve --workers N`` runs in each worker
process.

With workers, uvicorn starts N processes on one listening socket; each calls ``worker_app``
(named by import string, as uvicorn needs), which reads the command's options from
``WORKER_ENV`` and opens its own service. They share nothing but the index, so the index must be
a shared one (Redis): ``check_workers`` refuses an in-process index, which each worker would fill
and route on alone. Each worker counts its own in-flight load and per-key limits, as several
routers sharing a Redis index do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.fleet.index.from_url import check_index_url
from prefixcache.fleet.index.url_checks import IN_PROCESS
from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.access_config import ServerConfig
from prefixcache.fleet.service.configuration.config_file import ServiceConfig, load_config
from prefixcache.fleet.service.guards.connection_budget import service_budget
from prefixcache.fleet.service.guards.connection_shares import ConnectionShares
from prefixcache.fleet.service.transport import (
    HeadTimeoutProtocol,
    httptools_protocol,
)

WORKER_ENV = "PREFIXCACHE_SERVE_WORKER"  # JSON of ServeOptions, for the worker processes


@dataclass(frozen=True)
class ServeOptions:
    """What ``prefixcache serve`` was asked: the config file, an index URL overriding the
    config's, and proxying on or off (None: the config's)."""

    config: str
    index: str | None = None
    proxy: bool | None = None
    record_trace: str | None = None  # a path overriding the config's record_trace.path


def index_of(options: ServeOptions, config: ServiceConfig) -> str:
    """The index URL the service uses: ``--index``, else the config's."""
    return check_index_url(options.index, "--index") if options.index else config.index


def check_workers(workers: int, index_url: str) -> None:
    """ConfigError unless ``workers`` is at least 1 and, past 1, the index is a shared one."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    if workers > 1 and index_url in IN_PROCESS:
        raise ConfigError(
            f"--workers {workers} needs a shared index (--index redis://host:port/db, or a redis "
            f"index in the config): with the {index_url!r} index each worker process would hold "
            "an index of its own"
        )


def serve_config(options: ServeOptions) -> ServiceConfig:
    """The config file of ``options`` with the command's overrides applied: ``--index``,
    ``--proxy``/``--no-proxy`` and ``--record-trace``. Raises ConfigError for an unusable file
    or override."""
    config = load_config(Path(options.config))
    index = index_of(options, config)
    proxy = config.proxy
    if options.proxy is not None:
        proxy = dataclasses.replace(proxy, enabled=options.proxy)
    record = config.record_trace
    if options.record_trace is not None:
        record = dataclasses.replace(record, path=options.record_trace)
    return dataclasses.replace(config, index=index, proxy=proxy, record_trace=record)


def open_service(options: ServeOptions) -> tuple[Any, ServiceConfig]:
    """The service app of ``options`` (``build_service``: its index, router, KV-event
    subscriber, route observers ...), and its config with the command's overrides. Raises
    PrefixCacheError or OSError for an unusable config or index."""
    config = serve_config(options)
    return build_service(config), config


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Turn Nagle's algorithm off on a TCP connection (nothing for other sockets)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _NoDelay:
    """For workers, uvicorn binds the listening socket itself, without a protocol number, and
    asyncio only turns Nagle's algorithm off on connections of a socket that names TCP: an
    answer's head and body, written apart, would then wait for the client's delayed ACK (~40 ms).
    Each connection turns it off itself."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        """A new connection: no Nagle delay on it, then the protocol's own setup."""
        no_delay(transport)
        super().connection_made(transport)  # type: ignore[misc]


class WorkerProtocol(_NoDelay, HeadTimeoutProtocol):  # type: ignore[misc]
    """The h11 protocol of a worker process, with the head limits (a class uvicorn can name by
    import string); ``worker_app`` sets the config's limits."""


_FAST = httptools_protocol()
if _FAST is not None:

    class WorkerHttpToolsProtocol(_NoDelay, _FAST):  # type: ignore[misc, valid-type]
        """The httptools protocol of a worker process, with the head limits."""


def worker_protocol(server: ServerConfig) -> str:
    """The import string of the worker protocol for ``server.http``."""
    fast = _FAST is not None and server.http != "h11"  # httptools, when "auto" finds it
    name = "WorkerHttpToolsProtocol" if fast else "WorkerProtocol"
    return f"prefixcache.fleet.service.startup:{name}"


def worker_app() -> Any:
    """The app of one worker process, from the options in ``WORKER_ENV``."""
    options = ServeOptions(**json.loads(os.environ[WORKER_ENV]))
    app, config = open_service(options)
    budget = service_budget(config)
    for protocol in (WorkerProtocol, _FAST):
        if protocol is not None:
            protocol.head_timeout_s = config.server.header_timeout_s
            protocol.max_head_bytes = config.server.max_header_bytes
            protocol.shares = ConnectionShares(budget)
    return app
