"""Who is calling: API keys checked before any handler runs (``AccessGate``, a plain ASGI
middleware), and what a caller's key lets it see (``Caller``).

A request names its key as ``Authorization: Bearer <key>``, as vLLM's ``--api-key`` and the OpenAI
API take it. The presented key is hashed with SHA-256 and looked up among the digests of the
configured keys, so the time taken does not depend on how much of a stored key it matches.
``/healthz``, ``/health`` and ``/dashboard`` (a page without data) are open; ``/metrics``,
``/v1/whatif`` (with ``/v1/whatif/counterfactuals``) and ``/v1/replicas`` (and what is below it)
need an operator key (403 for a
tenant key); everything else needs a key (401 without one, with ``WWW-Authenticate: Bearer``).

A key's tenant fixes the namespace of its requests: the salt of every lookup, route and proxied
request is the tenant's (``Caller.salt``), with the request's own salt kept inside it, so no key
reaches another tenant's cached prefixes. Request ids are scoped per key
(``Caller.scoped_id``): the same id under two keys is two requests.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.fleet.router import MAX_REQUEST_ID_CHARS
from prefixcache.fleet.service.configuration.access_config import (
    OPERATOR,
    AccessConfig,
    ApiKey,
    key_digest,
)
from prefixcache.fleet.service.http_errors import error_response
from prefixcache.fleet.service.metrics import ServiceMetrics

OPEN_PATHS = frozenset(("/healthz", "/health", "/dashboard"))  # the page holds no data
OPERATOR_PATHS = frozenset(("/metrics", "/v1/replicas", "/v1/whatif", "/v1/whatif/counterfactuals"))
CALLER = "prefixcache.caller"  # the scope entry the gate leaves for the handlers


class Caller(NamedTuple):
    """The key behind a request (or the one anonymous caller of a service without keys)."""

    key_id: str | None  # fixed-length id of the key; None: no keys configured
    label: str  # the key's name in metrics
    tenant: str | None  # None: the unscoped view (no keys, or an operator without a tenant)
    operator: bool

    def salt(self, salt: str | None) -> str | None:
        """The salt a request with ``salt`` in its body is keyed under: the tenant's own, with
        the body's salt inside it (tenant names have no ':', so no two pairs give one salt)."""
        if self.tenant is None:
            return salt
        return f"tenant:{self.tenant}" if salt is None else f"tenant:{self.tenant}:{salt}"

    def scoped_id(self, request_id: str) -> str:
        """The router's id of this caller's ``request_id``: distinct for each key."""
        if self.key_id is None:
            return request_id
        scoped = f"{self.key_id}:{request_id}"
        if len(scoped) <= MAX_REQUEST_ID_CHARS:
            return scoped
        return f"{self.key_id}#{hashlib.sha256(request_id.encode('utf-8')).hexdigest()}"


ANONYMOUS = Caller(None, "(anonymous)", None, True)


def caller_for(key: ApiKey) -> Caller:
    """The caller a configured key makes."""
    return Caller(key.digest.hex()[:16], key.label, key.tenant, key.role == OPERATOR)


def caller_of(request: Request) -> Caller:
    """The caller the gate found for ``request`` (anonymous without keys)."""
    caller: Caller = request.scope.get(CALLER, ANONYMOUS)
    return caller


class AccessGate:
    """Checks the API key of every HTTP request before the app sees it."""

    def __init__(self, app: ASGIApp, access: AccessConfig, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self.callers = {key.digest: caller_for(key) for key in access.keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        caller = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and token:
                    caller = self.callers.get(key_digest(token.strip()))
                break
        if caller is None:
            await self._deny(scope, receive, send, 401, "unauthenticated", None)
            return
        path = scope["path"]
        if not caller.operator and (path in OPERATOR_PATHS or path.startswith("/v1/replicas/")):
            await self._deny(scope, receive, send, 403, "forbidden", caller)
            return
        scope[CALLER] = caller
        await self.app(scope, receive, send)

    async def _deny(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        reason: str,
        caller: Caller | None,
    ) -> None:
        path = scope["path"]
        label = "-" if caller is None else caller.label
        self.metrics.rejected.labels(reason, label).inc()
        if status == 401:
            message = "a valid API key is required: send 'Authorization: Bearer <key>'"
            response = error_response(401, "Unauthorized", f"{path}: {message}")
            response.headers["WWW-Authenticate"] = "Bearer"
        else:
            response = error_response(403, "Forbidden", f"{path} needs an operator key")
        await response(scope, receive, send)
