"""Proxy mode: OpenAI-compatible requests forwarded to the replica the router chooses.

``POST /v1/completions`` routes on the prompt (token ids when given, else the text through the
service's tokenizer with the special tokens it adds to a prompt, a BOS for most models, unless
the request's ``add_special_tokens`` is false, as vLLM tokenizes it; with several prompts, the
first); ``POST /v1/chat/completions`` routes on the messages rendered with the model's chat
template (``chat_template`` in the config; the request's ``add_generation_prompt``,
``continue_final_message``, ``tools``, ``documents`` and ``chat_template_kwargs`` apply as in
vLLM) and tokenized without added special tokens (the template writes them) unless the request
says ``add_special_tokens: true``: the token ids the engine computes (each engine's rule:
``FleetService.special_tokens``). Without a template the messages are rendered neutrally,
which matches other routed conversations but not what the replicas cache.

The body is forwarded as it came (re-encoded only to put a tenant's salt in, or the token ids
below), over a pooled keep-alive connection (``replica_client``), and the answer passed back
(``answer_relay``): an event stream relayed as it arrives, a JSON answer once it is whole. A
prompt of token ids is routed on the event loop (the index in this process,
``FleetService.inline``), and so is a text or chat whose token ids the tokenizer holds but for
a few words (seen before, or continued: ``FleetService.held_tokens``); other text and chat are
tokenized and routed in one trip to the thread pool. With ``proxy.forward_token_ids``, a text
completion (one text prompt, none of ``TEXT_ONLY_FIELDS``) is forwarded with the token ids the
service computed as its prompt, so the engine does not tokenize it again: the same answer, when
the service's tokenizer is the engine's (docs/service.md says when). The request counts
as load on its replica from the route until the answer ends, the client goes away, or the
replica fails. A replica that refuses the connection (or does not accept it in time) received
nothing: it is marked down at once and the request is routed again among the others, up to
``proxy.connect_retries`` times; a request whose bytes may have reached a replica is never sent
again. A failed request gives a 502 JSON error.
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

import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

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
from prefixcache.fleet.service.dispatch import INLINE_MAX_TOKENS, FleetService
from prefixcache.fleet.service.guards.access import Caller, caller_of
from prefixcache.fleet.service.http_errors import error_response
from prefixcache.fleet.service.openai_proxy.answer_relay import StreamRelay, whole_answer
from prefixcache.fleet.service.openai_proxy.replica_client import NotSentError, UpstreamError
from prefixcache.fleet.service.openai_proxy.usage_reader import UsageReader

_FORWARDED_REQUEST_HEADERS = ("content-type", "authorization", "accept", "x-request-id")
# what a text completion asks of its text itself (vLLM: the prompt echoed, a suffix, truncated as
# text, character offsets): such a request is forwarded as text
TEXT_ONLY_FIELDS = (
    "echo",
    "suffix",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "return_token_offsets",
)


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


def _completion_text(
    service: FleetService, payload: dict[str, Any], namespace: Namespace
) -> tuple[str | list[Any], bool]:
    """A completion's prompt (the first of several) and whether the engine adds the
    tokenizer's special tokens to it, as text (vLLM's rule: unless the request says
    ``add_special_tokens: false``; SGLang always adds them)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # several prompts: route on the first
    special = service.special_tokens(namespace, payload.get("add_special_tokens"), chat=False)
    if isinstance(prompt, str | list):
        return prompt, special
    raise InvalidArgumentError("'prompt' must be a string, a list of token ids, or a list of those")


def _completion_tokens(
    service: FleetService, payload: dict[str, Any], namespace: Namespace
) -> TokenIds:
    """A completion's prompt as the engine tokenizes it: a text with the tokenizer's special
    tokens unless the request says otherwise (``_completion_text``); token ids as given."""
    prompt, special = _completion_text(service, payload, namespace)
    if isinstance(prompt, str):
        return service.tokens_of(None, prompt, add_special_tokens=special)
    return service.tokens_of(prompt, None)


def _completion_held(
    service: FleetService, payload: dict[str, Any], namespace: Namespace
) -> TokenIds | None:
    """``_completion_tokens`` of a text prompt whose ids the tokenizer holds, else None."""
    prompt, special = _completion_text(service, payload, namespace)
    return service.held_tokens(prompt, special) if isinstance(prompt, str) else None


def _chat_options(
    service: FleetService, payload: dict[str, Any], namespace: Namespace
) -> tuple[bool, dict[str, Any]]:
    """Whether the engine adds the tokenizer's special tokens to a chat's rendered template
    (vLLM: only when the request says ``add_special_tokens: true``, as it renders the template
    to text, then tokenizes it with the request's value; SGLang has no such field and adds
    none), and the request's options for the template."""
    special = service.special_tokens(namespace, payload.get("add_special_tokens"), chat=True)
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
    options["extra"] = extra
    return special, options


def _chat_tokens(service: FleetService, payload: dict[str, Any], namespace: Namespace) -> TokenIds:
    """A chat's prompt as the engine tokenizes it: the template's text, with the special tokens
    ``_chat_options`` says."""
    special, options = _chat_options(service, payload, namespace)
    return service.chat_tokens(payload.get("messages"), add_special_tokens=special, **options)


def _chat_held(
    service: FleetService, payload: dict[str, Any], namespace: Namespace
) -> TokenIds | None:
    """``_chat_tokens`` when the tokenizer holds the ids of the rendered text, else None; None
    too for a request with tools or documents (their rendering is left off the event loop)."""
    special, options = _chat_options(service, payload, namespace)
    if options["tools"] or options["documents"]:
        return None
    return service.held_tokens(service.chat_text(payload.get("messages"), **options), special)


async def _forward(
    service: FleetService,
    request: Request,
    path: str,
    tokens_of: Callable[[FleetService, dict[str, Any], Namespace], TokenIds],
    held_of: Callable[[FleetService, dict[str, Any], Namespace], TokenIds | None],
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
    namespace = namespace_for(service, payload.get("model"), salt)
    inline = service.inline and _token_prompt(payload)
    tokens: TokenIds | None = tokens_of(service, payload, namespace) if inline else None
    as_ids = (
        not inline
        and service.config.proxy.forward_token_ids
        and path == "/v1/completions"
        and _ids_forwardable(payload)
    )
    if tokens is None and service.inline:  # a text seen (all but a few words): on the loop
        tokens = held_of(service, payload, namespace)
        inline = tokens is not None
    # one prompt, one answer: the engine's cached tokens are this prompt's
    model = namespace.adapter or namespace.model
    checked = service.delivery.config.enabled and _one_prompt(payload)
    headers = {k: v for k in _FORWARDED_REQUEST_HEADERS if (v := request.headers.get(k))}
    upstream_key = service.config.access.upstream_key
    if upstream_key is not None:
        headers["authorization"] = f"Bearer {upstream_key}"
    elif service.config.access.enabled:
        headers.pop("authorization", None)  # the caller's key is for this service only
    client = service.http_client
    retries = service.config.proxy.connect_retries
    refused: Response | None = None
    for attempt in range(retries + 1):
        request_id = uuid.uuid4().hex
        try:
            if tokens is None:  # text or chat: tokenized and routed off the loop, once
                tokens, decision = await run_in_threadpool(
                    _tokenize_and_route, service, caller, payload, namespace, tokens_of, request_id
                )
            elif inline:
                decision = _route(service, caller, namespace, tokens, request_id)
            else:  # routed again after a refusal, off the loop as the first time
                decision = await run_in_threadpool(
                    _route, service, caller, namespace, tokens, request_id
                )
        except NoHealthyReplicaError:
            if refused is None:
                raise
            return refused  # no other replica to try: the last refusal
        if as_ids:  # once: the engine takes the ids the service computed
            as_ids = False
            assert tokens is not None
            ids = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
            forwarded = {**payload, "prompt": ids}
            if salt is not None:
                forwarded["cache_salt"] = salt
            raw = msgspec.json.encode(forwarded)
        prediction = service.prediction(decision, model, caller) if checked else None
        release = _releaser(service, caller, request_id, prediction)
        url = f"{service.urls[decision.replica]}{path}"
        try:
            answer = await client.post(url, raw, headers)
        except NotSentError as exc:
            # the replica is unreachable: it takes no routes, and another one gets the request
            release()
            with suppress(UnknownReplicaError):
                reason = f"request failed: {exc.kind}"
                service.router.mark_down(decision.replica, service.config.health.down_s, reason)
            refused = _upstream_failed(service, path, decision.replica, url, exc)
            if attempt < retries:
                continue
            return refused
        except UpstreamError as exc:  # sent, or perhaps sent: never sent again
            release()
            return _upstream_failed(service, path, decision.replica, url, exc)
        except BaseException:
            release()
            raise
        extra = (
            (b"x-prefixcache-replica", decision.replica.encode()),
            (b"x-prefixcache-request-id", request_id.encode()),
        )
        reader = UsageReader(answer.content_type) if prediction is not None else None
        if answer.streamed:
            return StreamRelay(answer, extra, release, reader, decision.replica)
        return whole_answer(answer, extra, release, reader)
    raise AssertionError("unreachable")  # pragma: no cover


def _token_prompt(payload: dict[str, Any]) -> bool:
    """Whether the request's prompt is token ids, few enough to route on the event loop."""
    prompt = payload.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return False
    if isinstance(prompt[0], list):  # several prompts: the first
        prompt = prompt[0]
    return (
        isinstance(prompt, list)
        and len(prompt) <= INLINE_MAX_TOKENS
        and (not prompt or isinstance(prompt[0], int))
    )


def _ids_forwardable(payload: dict[str, Any]) -> bool:
    """Whether a completion's prompt can go on as token ids: one text, and nothing asked of
    the text itself."""
    return isinstance(payload.get("prompt"), str) and not any(
        payload.get(name) not in (None, False) for name in TEXT_ONLY_FIELDS
    )


def _tokenize_and_route(
    service: FleetService,
    caller: Caller,
    payload: dict[str, Any],
    namespace: Namespace,
    tokens_of: Callable[[FleetService, dict[str, Any], Namespace], TokenIds],
    request_id: str,
) -> tuple[TokenIds, RouteDecision]:
    """The prompt's token ids and its route (in the thread pool: the tokenizer)."""
    tokens = tokens_of(service, payload, namespace)
    return tokens, _route(service, caller, namespace, tokens, request_id)


def _route(
    service: FleetService,
    caller: Caller,
    namespace: Namespace,
    tokens: TokenIds,
    request_id: str,
) -> RouteDecision:
    """Route the prompt as ``request_id`` within ``caller``'s in-flight cap."""
    service.limits.reserve(caller)
    settled: str | None = None
    try:
        # always released: no in-flight timeout
        decision = service.route_tokens(namespace, tokens, request_id, expire=False)
        settled = request_id
    finally:
        service.limits.settle(caller, settled)
    return decision


def _releaser(
    service: FleetService, caller: Caller, request_id: str, prediction: Prediction | None
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
    service: FleetService, path: str, replica: str, url: str, exc: UpstreamError
) -> Response:
    service.metrics.errors.labels(path, "502").inc()
    return error_response(502, "UpstreamError", f"replica {replica} at {url} failed: {exc}")


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
    return await _forward(service, request, "/v1/completions", _completion_tokens, _completion_held)


async def chat_completions(request: Request) -> Response:
    """Forward a chat completion request to the chosen replica."""
    service: FleetService = request.app.state.service
    return await _forward(service, request, "/v1/chat/completions", _chat_tokens, _chat_held)


def add_proxy_routes(app: FastAPI) -> None:
    """Register the OpenAI-compatible forwarding endpoints on ``app`` (plain routes: the
    handlers read the request themselves, no dependency resolution per request)."""
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
