"""The HTTP service: the FastAPI app over a built ``FleetService`` (``serving_app``; the parts and
the app are built by ``assembly.build_service``), run by ``prefixcache serve``.

Endpoints (``routes``): ``POST /v1/lookup``, ``POST /v1/route``, ``POST /v1/release``,
``GET /v1/replicas``, ``GET /v1/models``, ``GET /healthz``, ``GET /health``, ``GET /metrics``;
with proxying on, also ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``proxy``).
Bad input gets a 4xx answer ``{"error": {"type": ..., "message": ...}}`` (``http_errors``) and
changes nothing. The handlers share one ``FleetService``, kept in ``app.state.service``.
With API keys in the config (``auth``), every request passes the ``access`` gate first; before
that, one client address may have only so many requests in progress (``client_limits``). While
the app runs, what clients cause is counted rather than logged line by line (``quiet_log``).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from prefixcache.errors import PrefixCacheError
from prefixcache.fleet.service.dispatch import FleetService
from prefixcache.fleet.service.guards.access import AccessGate
from prefixcache.fleet.service.guards.client_limits import ClientRequestLimit
from prefixcache.fleet.service.guards.connection_budget import service_budget
from prefixcache.fleet.service.guards.quiet_log import quiet_service_logs
from prefixcache.fleet.service.health_probe import probe_replicas
from prefixcache.fleet.service.http_errors import (
    aborted_request,
    http_error,
    nesting_error,
    typed_error,
    unexpected_error,
)
from prefixcache.fleet.service.routes import add_api_routes


def serving_app(service: FleetService) -> FastAPI:
    """The FastAPI app over a built ``service`` (``assembly.build_service`` builds both): its
    error handlers, endpoints, guards and lifespan; the service is ``app.state.service``."""
    config = service.config
    app = FastAPI(title="prefixcache fleet service", lifespan=_lifespan, openapi_url=None)
    app.state.service = service
    app.exception_handler(PrefixCacheError)(typed_error)
    app.exception_handler(StarletteHTTPException)(http_error)
    app.exception_handler(RecursionError)(nesting_error)
    app.exception_handler(ClientDisconnect)(aborted_request)
    app.exception_handler(Exception)(unexpected_error)
    add_api_routes(app)
    if service.proxying:
        from prefixcache.fleet.service.openai_proxy.proxy import add_proxy_routes

        add_proxy_routes(app)
    if config.access.enabled:  # a plain ASGI middleware: a check per request, nothing more
        app.add_middleware(AccessGate, access=config.access, metrics=service.metrics)
    per_client = service_budget(config).max_requests_per_client
    if per_client is not None:  # added last: it runs first, before any key is checked
        app.add_middleware(ClientRequestLimit, limit=per_client, metrics=service.metrics)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The service's lifetime: the replicas' HTTP client, the ingest, the health probes (of the
    replicas with a url, in either mode) and the route observers run from the app's start to its
    stop."""
    service: FleetService = app.state.service
    config, ingest = service.config, service.ingest
    if ingest is not None:
        await run_in_threadpool(ingest.start)
    prober = None
    # replicas with a url are probed in both modes: a route answered with a dead replica's url
    # is as lost as a forwarded request
    if config.health.probe_interval_s is not None and any(service.urls.values()):
        prober = asyncio.create_task(probe_replicas(service))
    # What exists once the service is up (modules, the app, the index) lives as long as it does:
    # frozen, the cyclic collector's full passes skip it and walk only what requests leave
    # behind (a full pass over everything took 15-30 ms, a stall in the latency tail).
    gc.collect()
    gc.freeze()
    restore_logs = quiet_service_logs(asyncio.get_running_loop())
    try:
        yield
    finally:
        restore_logs()
        gc.unfreeze()
        if prober is not None:
            prober.cancel()
            with suppress(asyncio.CancelledError):
                await prober
        if ingest is not None:
            await run_in_threadpool(ingest.stop)
        await service.http_client.close()
        await run_in_threadpool(service.observers.close)
