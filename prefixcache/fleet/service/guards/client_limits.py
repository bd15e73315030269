"""Requests in progress per client address (``ClientRequestLimit``, a plain ASGI middleware), so
that one client cannot hold the service's whole connection budget.

A request is in progress from its complete head until its answer is sent: a client that sends
heads and then trickles (or never sends) the bodies holds a connection per request. Past
``server.max_requests_per_client`` such requests from one address, the next gets 429 at once,
without its body being read, and its connection is closed, which frees its descriptor; the
refusal is counted in ``prefixcache_rejected_requests`` (reason ``client_limit``). The health
endpoints are never refused, so a load balancer's probes answer whatever its own address does.
Idle keep-alive connections and unfinished heads are not requests: ``server.keep_alive_s`` and
``server.header_timeout_s`` bound those.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.fleet.service.guards.access import OPEN_PATHS
from prefixcache.fleet.service.http_errors import error_response
from prefixcache.fleet.service.metrics import ServiceMetrics

CLIENT_LIMIT = "client_limit"  # the reason refusals are counted under


class ClientRequestLimit:
    """Counts each client address's requests in progress; refuses those past ``limit``."""

    def __init__(self, app: ASGIApp, limit: int, metrics: ServiceMetrics) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.in_progress: dict[str, int] = {}  # client address -> requests in progress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = client[0] if client else ""
        held = self.in_progress.get(address, 0)
        if held >= self.limit:
            await self._refuse(scope, receive, send, address)
            return
        self.in_progress[address] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_progress[address] - 1
            if left:
                self.in_progress[address] = left
            else:
                del self.in_progress[address]

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, address: str) -> None:
        self.metrics.rejected.labels(CLIENT_LIMIT, "-").inc()
        response = error_response(
            429,
            "TooManyRequests",
            f"{address or 'this client'} has {self.limit} requests in progress, the most one "
            "client address may have (server.max_requests_per_client): finish or close some",
        )
        response.headers["Retry-After"] = "1"
        response.headers["Connection"] = "close"  # its body is never read: the connection ends
        await response(scope, receive, send)
