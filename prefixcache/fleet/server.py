"""The HTTP service: a FastAPI app over a ``Router`` (``create_app``), run by ``prefixcache serve``.

Endpoints: ``POST /v1/lookup``, ``POST /v1/route``, ``POST /v1/release``, ``GET /v1/replicas``,
``GET /healthz``, ``GET /metrics``; with proxying on, also ``POST /v1/completions`` and
``POST /v1/chat/completions`` (see ``proxy.py``). Bad input gets a 4xx answer
``{"error": {"type": ..., "message": ...}}`` and changes nothing: bodies are read within the size
limit and decoded strictly before the router is called, and the router validates before it
records anything.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    MalformedJSONError,
    NoHealthyReplicaError,
    PayloadTooLargeError,
    PrefixCacheError,
    UnknownNamespaceError,
    UnknownReplicaError,
    UnknownRequestError,
)
from prefixcache.fleet.chat_template import ChatTemplate, chat_messages
from prefixcache.fleet.fleet_index import GPU
from prefixcache.fleet.ingest import IngestSource, IngestStats
from prefixcache.fleet.router import Lookup, ReplicaHealth, RouteDecision, Router
from prefixcache.fleet.routing import ReplicaScore
from prefixcache.fleet.service_bodies import (
    PromptBody,
    ReleaseBody,
    RouteBody,
    decode_body,
)
from prefixcache.fleet.service_config import ServiceConfig
from prefixcache.fleet.service_metrics import CONTENT_TYPE, ServiceMetrics
from prefixcache.namespace import Namespace
from prefixcache.replay.traces import Tokenizer, load_tokenizer, render_chat
from prefixcache.tokens import TokenIds

_STATUS: tuple[tuple[type[PrefixCacheError], int], ...] = (
    (PayloadTooLargeError, 413),
    (UnknownNamespaceError, 404),
    (UnknownRequestError, 404),
    (UnknownReplicaError, 404),
    (DuplicateRequestError, 409),
    (NoHealthyReplicaError, 503),
    (MalformedJSONError, 400),
    (ConfigError, 500),
)
_HTTP_STATUSES = {int(status) for status in HTTPStatus}


def error_response(status: int, kind: str, message: str) -> Response:
    """The JSON error answer every endpoint gives."""
    body = {"error": {"type": kind, "message": message, "status": status}}
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def status_of(exc: PrefixCacheError) -> int:
    """HTTP status for a typed error (``_STATUS``); 422 for any other bad input."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 422


def _json(data: Any) -> Response:
    return Response(msgspec.json.encode(data), media_type="application/json")


def _score(score: ReplicaScore) -> dict[str, Any]:
    return score._asdict()


def _health(health: ReplicaHealth | None) -> dict[str, Any]:
    if health is None:  # removed while the listing was built
        return {"up": False, "down_for_s": 0.0, "down_reason": "", "marked_down": 0}
    return {
        "up": health.up,
        "down_for_s": round(health.down_for_s, 3),
        "down_reason": health.reason,
        "marked_down": health.marked_down,
    }


class FleetService:
    """What the handlers share: router, config, tokenizer, chat template, metrics and the
    optional ingest."""

    def __init__(
        self,
        router: Router,
        config: ServiceConfig,
        tokenizer: Tokenizer,
        metrics: ServiceMetrics,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.router = router
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.metrics = metrics
        self.urls = {r.name: r.url for r in config.replicas}
        self.http_client: Any = None  # httpx.AsyncClient while proxying

    async def read_body(self, request: Request) -> bytes:
        """The request body, or PayloadTooLargeError past ``limits.max_body_bytes``."""
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise InvalidArgumentError(f"bad Content-Length header {declared!r}")
            if int(declared) > limit:
                raise PayloadTooLargeError(
                    f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes"
                )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def tokens_of(self, tokens: Sequence[int] | None, text: str | None) -> TokenIds:
        """The prompt's token ids: given ones, else ``text`` through the tokenizer. Checks the
        prompt-token limit."""
        if (tokens is None) == (text is None):
            raise InvalidArgumentError(
                "give exactly one of 'tokens' (token ids), 'text' or 'messages'"
            )
        ids: TokenIds = tokens if tokens is not None else self.tokenizer.encode(text or "")
        limit = self.config.limits.max_prompt_tokens
        if len(ids) > limit:
            raise PayloadTooLargeError(
                f"prompt has {len(ids)} tokens; this service accepts at most {limit}"
            )
        return ids

    def chat_tokens(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> TokenIds:
        """The token ids of a conversation: the chat template's text (a neutral rendering
        without one) through the tokenizer."""
        template = self.chat_template
        flat = chat_messages(messages, template.content_format if template else "string")
        if template is None:
            text = render_chat(flat)
        else:
            text = template.render(
                flat,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                extra=extra,
            )
        return self.tokens_of(None, text)

    def prompt(self, body: PromptBody) -> tuple[Namespace, TokenIds]:
        """Namespace and token ids of a lookup or route body."""
        if body.messages is not None:
            if body.tokens is not None or body.text is not None:
                raise InvalidArgumentError(
                    "give exactly one of 'tokens' (token ids), 'text' or 'messages'"
                )
            return body.namespace(), self.chat_tokens(body.messages)
        return body.namespace(), self.tokens_of(body.tokens, body.text)

    def lookup(self, body: PromptBody) -> tuple[Namespace, Lookup]:
        """A lookup body's namespace and per-replica scores."""
        namespace, tokens = self.prompt(body)
        return namespace, self.router.lookup(namespace, tokens)

    def route_body(self, body: RouteBody) -> RouteDecision:
        """Route a route body (its request id counts as load until released)."""
        namespace, tokens = self.prompt(body)
        return self.route(namespace, tokens, body.request_id)

    def route(
        self,
        namespace: Namespace,
        tokens: TokenIds,
        request_id: str | None,
        *,
        expire: bool = True,
    ) -> RouteDecision:
        """Route with the router and count the decision (``expire``: see ``Router.route``)."""
        start = time.perf_counter()
        decision = self.router.route(namespace, tokens, request_id, expire=expire)
        self.metrics.observe_route(decision, time.perf_counter() - start)
        return decision

    def release_quietly(self, request_id: str) -> None:
        """Release a request the service routed itself; a second release is not an error."""
        with suppress(UnknownRequestError):
            self.router.release(request_id)


async def probe_replicas(service: FleetService) -> None:
    """Every ``health.probe_interval_s``, GET each replica's URL + ``health.probe_path``: a
    failure (no answer in time, or not a 2xx) takes it out of routing for ``health.down_s`` (at
    least until the next probe), a success brings it back. Runs until cancelled."""
    import httpx

    health = service.config.health
    interval = health.probe_interval_s
    assert interval is not None
    # down at least until the next probe has had its time to answer
    down_s = max(health.down_s, interval + health.probe_timeout_s)
    router = service.router
    async with httpx.AsyncClient(timeout=health.probe_timeout_s) as client:
        while True:
            targets = [
                (spec.name, f"{url}{health.probe_path}")
                for spec in router.replicas()
                if (url := service.urls.get(spec.name))
            ]
            answers = await asyncio.gather(
                *(client.get(url) for _, url in targets), return_exceptions=True
            )
            for (name, _), answer in zip(targets, answers, strict=True):
                with suppress(UnknownReplicaError):  # removed from the fleet meanwhile
                    if isinstance(answer, BaseException):
                        reason = f"health probe failed: {type(answer).__name__}"
                        router.mark_down(name, down_s, reason)
                    elif not answer.is_success:
                        reason = f"health probe answered HTTP {answer.status_code}"
                        router.mark_down(name, down_s, reason)
                    else:
                        router.mark_up(name)
            await asyncio.sleep(interval)


def create_app(
    router: Router,
    config: ServiceConfig,
    *,
    tokenizer: Tokenizer | None = None,
    chat_template: ChatTemplate | None = None,
    ingest: IngestSource | None = None,
    ingest_stats: IngestStats | None = None,
    proxy: bool | None = None,
) -> FastAPI:
    """The service app over ``router``.

    ``tokenizer`` encodes text prompts (default: ``config.tokenizer``, else UTF-8 bytes);
    ``chat_template`` renders chat messages (default: ``config.chat_template``, if any).
    ``ingest`` is started when the app starts and stopped when it stops; its counters are
    exported when it (or ``ingest_stats``) implements ``IngestStats``. ``proxy`` overrides
    ``config.proxy.enabled``. Raises ConfigError for an unusable combination.
    """
    if ingest_stats is None and isinstance(ingest, IngestStats):
        ingest_stats = ingest
    proxying = config.proxy.enabled if proxy is None else proxy
    if proxying:
        missing = [r.name for r in config.replicas if r.url is None]
        if missing:
            raise ConfigError(f"proxy mode needs a url for every replica; missing: {missing}")
    service = FleetService(
        router,
        config,
        tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer),
        ServiceMetrics(router, ingest_stats),
        chat_template
        if chat_template is not None or config.chat_template is None
        else ChatTemplate.load(config.chat_template),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if proxying:
            import httpx

            timeout = httpx.Timeout(
                config.proxy.timeout_s, connect=min(10.0, config.proxy.timeout_s)
            )
            service.http_client = httpx.AsyncClient(timeout=timeout)
        if ingest is not None:
            await run_in_threadpool(ingest.start)
        prober = None
        if proxying and config.health.probe_interval_s is not None:
            prober = asyncio.create_task(probe_replicas(service))
        try:
            yield
        finally:
            if prober is not None:
                prober.cancel()
                with suppress(asyncio.CancelledError):
                    await prober
            if ingest is not None:
                await run_in_threadpool(ingest.stop)
            if service.http_client is not None:
                await service.http_client.aclose()

    app = FastAPI(title="prefixcache fleet service", lifespan=lifespan, openapi_url=None)
    app.state.service = service

    @app.exception_handler(PrefixCacheError)
    async def _typed_error(request: Request, exc: PrefixCacheError) -> Response:
        status = status_of(exc)
        service.metrics.errors.labels(request.url.path, str(status)).inc()
        response = error_response(status, type(exc).__name__, str(exc))
        if isinstance(exc, NoHealthyReplicaError):
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # unknown paths (404) and wrong methods (405) answer in the same JSON shape
        status = exc.status_code
        path = request.url.path
        known = any(getattr(route, "path", None) == path for route in app.routes)
        # an unknown path is not a label of its own: scanners would grow the metrics forever
        service.metrics.errors.labels(path if known else "(unknown)", str(status)).inc()
        kind = HTTPStatus(status).phrase.replace(" ", "") if status in _HTTP_STATUSES else "HTTP"
        response = error_response(
            status, kind, f"{request.method} {request.url.path}: {exc.detail}"
        )
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.post("/v1/lookup")
    async def lookup(request: Request) -> Response:
        """Cached prompt tokens per replica serving the prompt's namespace."""
        body = decode_body(await service.read_body(request), PromptBody)
        # tokenizing, hashing and the index (maybe Redis) block: off the event loop
        namespace, result = await run_in_threadpool(service.lookup, body)
        return _json(
            {
                "namespace": namespace.label(),
                "prompt_tokens": result.prompt_tokens,
                "replicas": [_score(s) for s in result.scores],
            }
        )

    @app.post("/v1/route")
    async def route(request: Request) -> Response:
        """Choose a replica for the prompt; with a request_id, count it as load."""
        body = decode_body(await service.read_body(request), RouteBody)
        decision = await run_in_threadpool(service.route_body, body)
        return _json(
            {
                "replica": decision.replica,
                "url": service.urls.get(decision.replica),
                "policy": decision.policy,
                "rule": decision.rule,
                "request_id": decision.request_id,
                "prompt_tokens": decision.prompt_tokens,
                "cached_tokens": decision.cached_tokens,
                "gpu_cached_tokens": decision.gpu_cached_tokens,
                "scores": [_score(s) for s in decision.scores],
            }
        )

    @app.post("/v1/release")
    async def release(request: Request) -> Response:
        """End a routed request's load."""
        body = decode_body(await service.read_body(request), ReleaseBody)
        released = await run_in_threadpool(router.release, body.request_id)
        return _json(released._asdict())

    def replica_rows() -> list[dict[str, Any]]:
        loads = {load.name: load for load in router.loads()}
        health = {h.name: h for h in router.health()}
        specs = router.replicas()
        names = [spec.name for spec in specs]
        held = router.index.num_blocks_many(names)  # one round trip each on a shared index
        on_gpu = router.index.num_blocks_many(names, GPU)
        out = []
        for spec in specs:
            rc = config.replica(spec.name)
            load = loads.get(spec.name)
            ns = spec.namespace
            out.append(
                {
                    "name": spec.name,
                    "url": rc.url if rc else None,
                    "events": rc.events if rc else None,
                    "replay": rc.replay if rc else None,
                    "model": ns.model,
                    "adapter": ns.adapter,
                    "adapter_version": ns.adapter_version,
                    "salt": ns.salt,
                    "extra": list(ns.extra),
                    "namespace": ns.label(),
                    "block_size": spec.block_size,
                    "capacity_blocks": spec.capacity_blocks,
                    "in_flight": load.in_flight if load else 0,
                    "in_flight_tokens": load.in_flight_tokens if load else 0,
                    "index_blocks": held[spec.name],
                    "index_gpu_blocks": on_gpu[spec.name],
                    **_health(health.get(spec.name)),
                }
            )
        return out

    @app.get("/v1/replicas")
    async def replicas() -> Response:
        """Every replica: config, load and the blocks the index holds for it."""
        rows = await run_in_threadpool(replica_rows)  # the index may be remote (Redis)
        return _json({"policy": router.policy, "replicas": rows})

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the service answers and knows its replicas."""
        return _json(
            {
                "status": "ok",
                "replicas": len(router.replicas()),
                "replicas_up": sum(h.up for h in router.health()),
                "policy": router.policy,
                "proxy": proxying,
                "ingest": ingest is not None,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition of the service's own registry."""
        # off the event loop: the index may be remote, and ingest counters are read in a thread
        body = await run_in_threadpool(service.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    if proxying:
        from prefixcache.fleet.proxy import add_proxy_routes

        add_proxy_routes(app, service)
    return app
