"""The service of one process from a config file (``open_service``: index, router, KV-event
subscriber, app), and what ``prefixcache serve --workers N`` runs in each worker process.

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
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.from_url import check_index_url, open_index
from prefixcache.fleet.index.url_checks import IN_PROCESS
from prefixcache.fleet.service.app import create_app
from prefixcache.fleet.service.configuration.access_config import ServerConfig
from prefixcache.fleet.service.configuration.config_file import (
    ServiceConfig,
    build_router,
    load_config,
)
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


def open_service(options: ServeOptions) -> tuple[Any, ServiceConfig]:
    """The service app of ``options`` (its index, router and KV-event subscriber), and its
    config. Raises PrefixCacheError or OSError for an unusable config or index."""
    config = load_config(Path(options.config))
    if options.record_trace is not None:
        record = dataclasses.replace(config.record_trace, path=options.record_trace)
        config = dataclasses.replace(config, record_trace=record)
    index_url = index_of(options, config)
    extra: dict[str, float] = {}
    if index_url not in IN_PROCESS:
        extra["read_timeout"] = config.limits.redis_read_timeout_s
    index = open_index(index_url, prefix=config.index_prefix, **extra)
    router = build_router(config, index)
    # every replica with an event endpoint is followed from the app's start to its stop
    subscriber = KVEventSubscriber(
        index,
        [
            ReplicaEndpoint(
                r.name,
                r.events,
                r.replay,
                r.namespace,
                r.block_size,
                hash_algo=config.hash_algo,
                engine_hash=r.engine_hash,
                kv_store=r.kv_store,
                bind=r.events_bind,
            )
            for r in config.replicas
            if r.events is not None
        ],
        max_replicas=config.limits.max_replicas,
        max_message_bytes=config.limits.max_event_message_bytes,
        replay_deadline=config.limits.replay_deadline_s,
        max_replay_frames=config.limits.max_replay_frames,
        ingest_workers=config.limits.ingest_workers,
    )
    if config.routing.tenant_shares:  # room per tenant, from the replicas' events
        router.attach_tenant_shares(config.routing.tenant_shares, subscriber.tenant_gpu_blocks)
    return create_app(router, config, proxy=options.proxy, ingest=subscriber), config


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
