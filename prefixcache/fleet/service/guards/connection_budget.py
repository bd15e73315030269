"""How many connections the service can hold on its open-file limit (``connection_budget``), the
limit raised at start when the hard limit allows (``raise_descriptor_limit``), and what happens
at the connection level past the budget (``ConnectionEvents``).

Every connection is a file descriptor; so are the event loop, the listening socket, the index's
and the KV events' sockets and the files the service opens. A process past its
``RLIMIT_NOFILE`` cannot accept (asyncio's accept loop fails with EMFILE and stops accepting
for a second), so the budget keeps connections below it:

- ``RESERVED_DESCRIPTORS`` (plus ``DESCRIPTORS_PER_FOLLOWED_REPLICA`` per replica whose KV
  events are followed) stay for the service itself;
- ``ACCEPT_HEADROOM`` more than ``max_connections`` are accepted, so that a connection past the
  limit still gets uvicorn's 503 and asyncio's accept loop has descriptors for what arrives at
  once; a connection beyond that is closed unanswered (``ConnectionEvents.closed_over_limit``);
- ``server.max_connections`` larger than what is left is lowered to it, with a warning naming
  the limit to raise;
- one client address may have ``server.max_requests_per_client`` requests in progress (default:
  half the connections), so that it cannot hold the whole budget (``client_limits``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prefixcache.errors import ConfigError
from prefixcache.fleet.service.configuration.access_config import ServerConfig
from prefixcache.fleet.service.configuration.config_file import ServiceConfig

try:  # POSIX only: elsewhere the budget is the configured limits as they are
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

RESERVED_DESCRIPTORS = 64  # stdio, the event loop, the listening socket, index sockets, files
DESCRIPTORS_PER_FOLLOWED_REPLICA = 2  # its KV event socket and its replay socket
ACCEPT_HEADROOM = 64  # connections past max_connections that are still answered (503)
MIN_CONNECTIONS = 8  # a descriptor limit that leaves fewer is refused at start


@dataclass(frozen=True)
class ConnectionBudget:
    """The connection limits the service runs with, after the open-file limit."""

    max_connections: int | None  # requests on connections beyond it get 503 (None: no limit)
    max_open_connections: int | None  # a connection beyond it is closed unanswered
    max_requests_per_client: int | None  # requests in progress per client address
    descriptors: int | None  # the soft RLIMIT_NOFILE it was computed for (None: unknown)
    warning: str | None = None  # why max_connections was lowered, and what to raise

    @property
    def descriptors_needed(self) -> int | None:
        """The open-file limit the configured connections need (None: no connection limit)."""
        if self.max_open_connections is None:
            return None
        return self.max_open_connections + RESERVED_DESCRIPTORS


def descriptor_limits() -> tuple[int, int] | None:
    """The (soft, hard) open-file limit of this process (``resource.RLIM_INFINITY`` for none),
    or None where the platform has no such limit."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def reserved_descriptors(followed_replicas: int) -> int:
    """Descriptors kept for the service itself, following ``followed_replicas`` event streams."""
    return RESERVED_DESCRIPTORS + DESCRIPTORS_PER_FOLLOWED_REPLICA * followed_replicas


def connection_budget(
    server: ServerConfig, followed_replicas: int = 0, limits: tuple[int, int] | None = None
) -> ConnectionBudget:
    """The limits ``server`` runs with under the open-file limit ``limits`` (default: this
    process's). ConfigError when the limit leaves fewer than ``MIN_CONNECTIONS`` connections."""
    limits = descriptor_limits() if limits is None else limits
    wanted = server.max_connections
    soft = None if limits is None or _unlimited(limits[0]) else limits[0]
    hard = None if limits is None else limits[1]
    warning = None
    cap = wanted
    if soft is not None and hard is not None:
        reserve = reserved_descriptors(followed_replicas)
        usable = soft - reserve - ACCEPT_HEADROOM
        if usable < MIN_CONNECTIONS:
            raise ConfigError(
                f"the open-file limit is {soft}: the service needs at least "
                f"{reserve + ACCEPT_HEADROOM + MIN_CONNECTIONS} (raise it with ulimit -n)"
            )
        if wanted is None or wanted > usable:
            cap = usable
        if wanted is not None and wanted > usable:
            needed = wanted + reserve + ACCEPT_HEADROOM
            warning = (
                f"server.max_connections {wanted} needs an open-file limit of {needed} "
                f"({reserve} kept for the service, {ACCEPT_HEADROOM} for connections answered "
                f"503 past the limit), but it is {soft} (hard limit {_shown(hard)}): "
                f"serving at most {usable} connections. Raise the limit (ulimit -n {needed}, "
                f"or LimitNOFILE={needed} under systemd) or lower server.max_connections to "
                f"{usable}."
            )
    per_client = server.max_requests_per_client
    if per_client is None and cap is not None:
        per_client = max(1, cap // 2)
    return ConnectionBudget(
        cap,
        None if cap is None else cap + ACCEPT_HEADROOM,
        per_client,
        soft,
        warning,
    )


def followed_replicas(config: ServiceConfig) -> int:
    """The replicas whose KV events the service follows (each holds sockets of its own)."""
    return sum(r.events is not None for r in config.replicas)


def service_budget(config: ServiceConfig) -> ConnectionBudget:
    """The connection limits of the service ``config`` describes, in this process now."""
    return connection_budget(config.server, followed_replicas(config))


def raise_descriptor_limit(server: ServerConfig, followed_replicas: int = 0) -> str | None:
    """Raise this process's soft open-file limit to what ``server.max_connections`` needs, as
    far as the hard limit allows; a line saying so when it was raised, else None."""
    limits = descriptor_limits()
    if resource is None or limits is None or server.max_connections is None:
        return None
    soft, hard = limits
    needed = server.max_connections + reserved_descriptors(followed_replicas) + ACCEPT_HEADROOM
    if _unlimited(soft) or soft >= needed:
        return None
    target = needed if _unlimited(hard) else min(needed, hard)
    if target <= soft:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return None
    return f"raised the open-file limit from {soft} to {target} for server.max_connections"


def _unlimited(value: int) -> bool:
    return resource is not None and value == resource.RLIM_INFINITY


def _shown(value: int) -> str:
    return "unlimited" if _unlimited(value) else str(value)


class ConnectionEvents:
    """What happened to connections below the app, counted since the process started: closed
    unanswered for want of room, closed while waiting on their client to make room for a new
    one (``connection_shares``), and accepts that failed for lack of descriptors (or memory).
    Read by the metrics at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed_over_limit = 0
        self.evicted = 0
        self.accept_failures = 0

    def count_closed_over_limit(self) -> None:
        """One connection closed unanswered because the service holds its maximum."""
        with self._lock:
            self.closed_over_limit += 1

    def count_evicted(self) -> None:
        """One waiting connection closed to make room for a new one (``connection_shares``)."""
        with self._lock:
            self.evicted += 1

    def count_accept_failure(self) -> None:
        """One accept() that failed (EMFILE, ENFILE, ENOBUFS, ENOMEM)."""
        with self._lock:
            self.accept_failures += 1


CONNECTION_EVENTS = ConnectionEvents()  # one per process: the event loop and its protocols
