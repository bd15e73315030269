"""Proxy mode: OpenAI-compatible requests forwarded to the replica the router chooses.

``POST /v1/completions`` routes on the prompt (token ids when given, else the text through the
service's tokenizer; with several prompts, the first); ``POST /v1/chat/completions`` routes on
the messages rendered with the model's chat template (``chat_template`` in the config; the
request's ``add_generation_prompt``, ``continue_final_message``, ``tools``, ``documents`` and
``chat_template_kwargs`` apply as in vLLM) and tokenized without added special tokens: the token
ids the engine computes. Without a template the messages are rendered neutrally, which matches
other routed conversations but not what the replicas cache.

The body is forwarded unchanged and the answer streamed back as it arrives (server-sent events
included). The request counts as load on its replica from the route until the answer ends, the
client goes away, or the replica fails. A replica that refuses the connection (or does not
accept it in time) received nothing: it is marked down at once and the request is routed again
among the others, up to ``proxy.connect_retries`` times; a request whose bytes may have reached a
replica is never sent again. A failed request gives a 502 JSON error.
The model name selects the namespace: the base model of a replica whose model it is, or a
LoRA adapter (how vLLM names LoRA modules) that a replica has as its own or lists in
``adapters``; vLLM's ``cache_salt`` becomes the salt. Which replicas may take the request is the
router's rule (``ReplicaSpec.serves``).

With API keys, the caller's tenant salt (``Caller.salt``) replaces the body's ``cache_salt`` in
what is forwarded, so the engine's blocks, and the KV events the index learns them from, are the
tenant's own; the caller's key is not passed on (``auth.upstream_key_env`` names the one the
replicas take). Each request counts against its key's rate limit and in-flight cap.

The engine's cached-token figure (``usage.prompt_tokens_details.cached_tokens``) is read from
each one-prompt answer as it passes (``usage_reader``) and checked against what the route
predicted (``FleetService.delivery``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import TokenIds
from prefixcache.errors import (
    InvalidArgumentError,
    NoHealthyReplicaError,
    UnknownNamespaceError,
    UnknownReplicaError,
)
from prefixcache.fleet.delivery_check import Prediction
from prefixcache.fleet.replica_spec import ANY_ADAPTER, pinned_adapter_versions, served_label
from prefixcache.fleet.router import RouteDecision
from prefixcache.fleet.service.bodies import decode_body
from prefixcache.fleet.service.dispatch import FleetService
from prefixcache.fleet.service.guards.access import caller_of
from prefixcache.fleet.service.http_errors import error_response
from prefixcache.fleet.service.usage_reader import UsageReader

_DROPPED_HEADERS = frozenset(
    ("content-length", "transfer-encoding", "connection", "keep-alive", "host")
)
_FORWARDED_REQUEST_HEADERS = ("content-type", "authorization", "accept", "x-request-id")


class _UpstreamStream(StreamingResponse):
    """The replica's answer, relayed chunk by chunk; ``on_close`` runs however it ends, with the
    engine's cached-token figure when ``reader`` found one in what passed (else None)."""

    def __init__(
        self,
        upstream: httpx.Response,
        extra_headers: dict[str, str],
        on_close: Callable[[int | None], None],
        reader: UsageReader | None,
    ) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}
        headers.update(extra_headers)
        replica = extra_headers.get("x-prefixcache-replica", "the replica")
        relay = self._relay(upstream, replica, reader)
        super().__init__(relay, status_code=upstream.status_code, headers=headers)
        self._upstream = upstream
        self._on_close = on_close
        self._reader = reader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._upstream.aclose()
            finally:
                # the figure, as soon as the answer carried it, whether or not the client
                # stayed for the rest (a stream's usage chunk comes before data: [DONE])
                reader = self._reader
                ok = reader is not None and self._upstream.status_code == 200
                self._on_close(reader.close() if ok and reader is not None else None)

    async def _relay(
        self, upstream: httpx.Response, replica: str, reader: UsageReader | None
    ) -> AsyncIterator[bytes]:
        """The replica's bytes as they come (each also to ``reader``). If it breaks off
        mid-answer, a streamed answer ends with an error event, as vLLM ends a stream that fails
        (clients raise on it; a cut-off stream would read as a short answer); any other answer
        just ends there."""
        try:
            async for chunk in upstream.aiter_raw():
                if reader is not None:
                    reader.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                error = {
                    "message": f"replica {replica} broke off the answer: {type(exc).__name__}",
                    "type": "UpstreamError",
                    "code": 502,
                }
                yield b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"


def namespace_for(service: FleetService, model: Any, salt: Any) -> Namespace:
    """The served namespace an OpenAI ``model`` (and ``cache_salt``) names."""
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError("'model' must be a non-empty string")
    if salt is not None and not isinstance(salt, str):
        raise InvalidArgumentError("'cache_salt' must be a string")
    specs = service.router.replicas()
    for spec in specs:  # the base model, as its replicas name it
        own = spec.namespace
        if own.model == model and own.adapter is None:
            ns = Namespace(model, None, own.adapter_version, salt, own.extra)
            if spec.serves(ns):
                return ns
    if not any(spec.namespace.model == model for spec in specs):  # a LoRA adapter
        versions = pinned_adapter_versions(spec.namespace for spec in specs)
        for spec in specs:
            own = spec.namespace
            if own.adapter == model or model in spec.adapters or ANY_ADAPTER in spec.adapters:
                # the fleet's version of the adapter (the ingest files blocks under it)
                version = versions.get((own.model, model))
                ns = Namespace(own.model, model, version, salt, own.extra)
                if spec.serves(ns):
                    return ns
    served = ", ".join(dict.fromkeys(served_label(spec) for spec in specs)) or "none"
    raise UnknownNamespaceError(
        f"no replica serves model {model!r}"
        + ("" if salt is None else f" with cache_salt {salt!r}")
        + f"; served: {served}"
    )


def _completion_tokens(service: FleetService, payload: dict[str, Any]) -> TokenIds:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # several prompts: route on the first
    if isinstance(prompt, str):
        return service.tokens_of(None, prompt)
    if isinstance(prompt, list):
        return service.tokens_of(prompt, None)
    raise InvalidArgumentError("'prompt' must be a string, a list of token ids, or a list of those")


def _chat_tokens(service: FleetService, payload: dict[str, Any]) -> TokenIds:
    options: dict[str, Any] = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = payload.get(name, default)
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"'{name}' must be true or false, got {value!r}")
        options[name] = value
    for name in ("tools", "documents"):
        value = payload.get(name)
        if value is not None and not isinstance(value, list):
            raise InvalidArgumentError(f"'{name}' must be a list, got {type(value).__name__}")
        options[name] = value
    extra = payload.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise InvalidArgumentError("'chat_template_kwargs' must be an object")
    return service.chat_tokens(payload.get("messages"), extra=extra, **options)


async def _forward(
    service: FleetService,
    request: Request,
    path: str,
    tokens_of: Callable[[FleetService, dict[str, Any]], TokenIds],
) -> Response:
    caller = caller_of(request)
    service.limits.take(caller)
    raw = await service.read_body(request, caller)
    payload = decode_body(raw, dict[str, Any])
    given_salt = payload.get("cache_salt")
    if given_salt is not None and not isinstance(given_salt, str):
        raise InvalidArgumentError("'cache_salt' must be a string")
    salt = caller.salt(given_salt)
    if salt != given_salt:  # the engine keys the blocks under the tenant's salt
        raw = msgspec.json.encode({**payload, "cache_salt": salt})

    def prompt() -> tuple[Namespace, TokenIds]:  # tokenizing: off the loop
        return namespace_for(service, payload.get("model"), salt), tokens_of(service, payload)

    namespace, tokens = await run_in_threadpool(prompt)
    # one prompt, one answer: the engine's cached tokens are this prompt's
    model = namespace.adapter or namespace.model
    checked = service.delivery.config.enabled and _one_prompt(payload)
    headers = {k: v for k in _FORWARDED_REQUEST_HEADERS if (v := request.headers.get(k))}
    upstream_key = service.config.access.upstream_key
    if upstream_key is not None:
        headers["authorization"] = f"Bearer {upstream_key}"
    elif service.config.access.enabled:
        headers.pop("authorization", None)  # the caller's key is for this service only
    retries = service.config.proxy.connect_retries
    refused: Response | None = None
    for attempt in range(retries + 1):
        request_id = uuid.uuid4().hex
        try:
            decision = await _route(service, caller, namespace, tokens, request_id)
        except NoHealthyReplicaError:
            if refused is None:
                raise
            return refused  # no other replica to try: the last refusal
        prediction = service.prediction(decision, model, caller) if checked else None
        release = _releaser(service, caller, request_id, prediction)
        url = f"{service.urls[decision.replica]}{path}"
        try:
            upstream = await service.http_client.send(
                service.http_client.build_request("POST", url, content=raw, headers=headers),
                stream=True,
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # nothing was sent: the replica is unreachable; it takes no routes, and another
            # one gets the request
            release()
            with suppress(UnknownReplicaError):
                reason = f"request failed: {type(exc).__name__}"
                service.router.mark_down(decision.replica, service.config.health.down_s, reason)
            refused = _upstream_failed(service, path, decision.replica, url, exc)
            if attempt < retries:
                continue
            return refused
        except httpx.HTTPError as exc:  # sent, or perhaps sent: never sent again
            release()
            return _upstream_failed(service, path, decision.replica, url, exc)
        except BaseException:
            release()
            raise
        extra = {"x-prefixcache-replica": decision.replica, "x-prefixcache-request-id": request_id}
        reader = None
        if prediction is not None:
            reader = UsageReader(upstream.headers.get("content-type", ""))
        return _UpstreamStream(upstream, extra, release, reader)
    raise AssertionError("unreachable")  # pragma: no cover


async def _route(
    service: FleetService, caller: Any, namespace: Namespace, tokens: TokenIds, request_id: str
) -> RouteDecision:
    """Route the prompt as ``request_id`` within ``caller``'s in-flight cap (hashing and the
    index: off the loop)."""
    service.limits.reserve(caller)
    settled: str | None = None
    try:
        decision: RouteDecision = await run_in_threadpool(
            service.route_tokens, namespace, tokens, request_id, expire=False
        )  # always released: no in-flight timeout
        settled = request_id
    finally:
        service.limits.settle(caller, settled)
    return decision


def _releaser(
    service: FleetService, caller: Any, request_id: str, prediction: Prediction | None
) -> Callable[..., None]:
    """Ends the load of ``request_id`` once (with the engine's cached-token figure, checked
    against ``prediction``)."""
    released = False

    def release(delivered: int | None = None) -> None:
        nonlocal released
        if not released:
            released = True
            service.release_quietly(request_id)
            service.limits.forget(caller, request_id)
            if prediction is not None:
                service.delivery.observe(prediction, delivered)

    return release


def _upstream_failed(
    service: FleetService, path: str, replica: str, url: str, exc: Exception
) -> Response:
    service.metrics.errors.labels(path, "502").inc()
    return error_response(
        502, "UpstreamError", f"replica {replica} at {url} failed: {type(exc).__name__}: {exc}"
    )


def _one_prompt(payload: dict[str, Any]) -> bool:
    """Whether the answer's usage is one prompt's: one prompt (or a chat) and one choice."""
    n = payload.get("n")
    if n is not None and n != 1:
        return False
    prompt = payload.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
    return not several


async def completions(request: Request) -> Response:
    """Forward a completion request to the chosen replica."""
    service: FleetService = request.app.state.service
    return await _forward(service, request, "/v1/completions", _completion_tokens)


async def chat_completions(request: Request) -> Response:
    """Forward a chat completion request to the chosen replica."""
    service: FleetService = request.app.state.service
    return await _forward(service, request, "/v1/chat/completions", _chat_tokens)


def add_proxy_routes(app: FastAPI) -> None:
    """Register the OpenAI-compatible forwarding endpoints on ``app``."""
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
