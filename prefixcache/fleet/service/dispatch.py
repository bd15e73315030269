"""What the service's handlers share (``FleetService``): the router, the config, the tokenizer and
chat template that turn a request into token ids, the metrics, the per-key limits, the delivery
check, the route observers, the optional ingest, and the HTTP client the replicas are reached
with, each built by ``assembly.build_service`` and handed over ready.

A request is served for its ``Caller`` (``access``): its prompt is keyed under the caller's tenant
salt, and its request id is the caller's own (scoped per key).

Where the router's work runs: with the index in this process (``memory``, ``memory+compact``), a
prompt of token ids up to ``INLINE_MAX_TOKENS`` is routed on the event loop itself, since handing
it to a worker thread (and the GIL back) costs more than the route, and so is a proxied text or
chat whose token ids the tokenizer holds in full (``held_tokens``: no tokenizer runs); other text
and chat prompts (the tokenizer), longer prompts and a remote index (Redis round trips) run in
the thread pool, so they never hold up the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, NamedTuple

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import TokenIds
from prefixcache.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    PayloadTooLargeError,
    UnknownRequestError,
)
from prefixcache.fleet.delivery_check import DeliveryCheck, Prediction
from prefixcache.fleet.events.ingest import IngestSource
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.replica_load import Released
from prefixcache.fleet.router import PromptScores, RouteDecision, Router
from prefixcache.fleet.service.bodies import PromptBody, RouteBody
from prefixcache.fleet.service.configuration.config_file import ServiceConfig
from prefixcache.fleet.service.guards.access import ANONYMOUS, Caller
from prefixcache.fleet.service.guards.key_limits import KeyLimits
from prefixcache.fleet.service.http_errors import BodyTimeoutError
from prefixcache.fleet.service.metrics import ServiceMetrics
from prefixcache.fleet.service.openai_proxy.replica_client import ReplicaClient
from prefixcache.fleet.service.route_observers import RouteObservers
from prefixcache.text.chat_template import ChatTemplate, chat_messages
from prefixcache.text.prefix_tokenizer import PrefixTokenizer
from prefixcache.text.tokenizers import Tokenizer, render_chat

# the most token ids of a prompt routed on the event loop when the index is in this process; a
# longer prompt goes to the thread pool, so that its hashing does not stall every other request
INLINE_MAX_TOKENS = 16_384
# the most characters of a text tokenized on the event loop (what a text that continues one seen
# before adds: 0.1-0.3 ms of a tokenizer's time, less than the trip to a worker thread and back)
INLINE_TEXT_CHARS = 2048


class Prompt(NamedTuple):
    """A request's prompt: the namespace it belongs to and its token ids."""

    namespace: Namespace
    tokens: TokenIds


class FleetService:
    """What the handlers share: router, config, tokenizer, chat template, metrics, per-key
    limits, the delivery check, the route observers, the replicas' HTTP client and the optional
    ingest. Built from ready parts (``assembly.build_service`` builds them); it builds none."""

    def __init__(
        self,
        config: ServiceConfig,
        router: Router,
        *,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        metrics: ServiceMetrics,
        limits: KeyLimits,
        delivery: DeliveryCheck,
        observers: RouteObservers,
        http_client: ReplicaClient,
        ingest: IngestSource | None,
    ) -> None:
        self.config = config
        self.router = router
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.metrics = metrics
        self.limits = limits
        # what the engines deliver against what routing predicted (a degraded replica keeps
        # its routes: the verdict is for the operator, see docs/service.md)
        self.delivery = delivery
        self.observers = observers  # closed when the app stops
        # HTTP to the replicas (proxying, probes): opened at first use, closed with the app
        self.http_client = http_client
        self.ingest = ingest  # started and stopped with the app
        self.probes: dict[str, Any] = {}  # replica -> its last attach probe's ProbeResult
        self._block_sizes = {r.name: r.block_size for r in config.replicas}
        self.proxying = config.proxy.enabled  # the OpenAI-compatible endpoints forward
        self.urls = {r.name: r.url for r in config.replicas}
        self.started_at = time.time()  # the "created" of the models it lists
        # an index in this process (CompactFleetIndex is one too) answers without blocking
        self.inline = isinstance(router.index, MemoryFleetIndex)

    def runs_inline(self, body: PromptBody) -> bool:
        """Whether ``body`` is routed on the event loop: token ids (no tokenizer), at most
        ``INLINE_MAX_TOKENS`` of them, and the index in this process."""
        tokens = body.tokens
        return (
            self.inline
            and tokens is not None
            and body.text is None
            and body.messages is None
            and len(tokens) <= INLINE_MAX_TOKENS
        )

    async def _run(self, inline: bool, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the event loop when ``inline``, else in the thread pool."""
        if inline:
            return fn(*args)
        return await run_in_threadpool(fn, *args)

    async def read_body(self, request: Request, caller: Caller = ANONYMOUS) -> bytes:
        """The request body; PayloadTooLargeError past ``limits.max_body_bytes``,
        BodyTimeoutError when it takes longer than ``server.body_timeout_s`` to arrive."""
        timeout = self.config.server.body_timeout_s
        try:
            if sys.version_info >= (3, 11):  # no task of its own per request, as wait_for has
                async with asyncio.timeout(timeout):
                    return await self._read_body(request)
            return await asyncio.wait_for(self._read_body(request), timeout)
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("body_timeout", caller.label).inc()
            raise BodyTimeoutError(
                f"the request body did not arrive within {timeout:g} s: send the whole body "
                "within server.body_timeout_s"
            ) from None

    async def _read_body(self, request: Request) -> bytes:
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

    def tokens_of(
        self, tokens: Sequence[int] | None, text: str | None, *, add_special_tokens: bool = False
    ) -> TokenIds:
        """The prompt's token ids: given ones, else ``text`` through the tokenizer, with the
        special tokens it adds to a prompt when ``add_special_tokens`` (the router checks the
        prompt-token limit, once, for every way in)."""
        if (tokens is None) == (text is None):
            raise InvalidArgumentError(
                "give exactly one of 'tokens' (token ids), 'text' or 'messages'"
            )
        if tokens is not None:
            return tokens
        ids: TokenIds = self.tokenizer.encode(text or "", add_special_tokens)
        return ids

    def held_tokens(self, text: str, add_special_tokens: bool) -> TokenIds | None:
        """``text``'s token ids (as ``tokens_of``) when the tokenizer holds all but at most
        ``INLINE_TEXT_CHARS`` characters of it (a text seen before, or one that continues it),
        so that the tokenizer runs briefly or not at all: cheap enough for the event loop. None
        otherwise."""
        if isinstance(self.tokenizer, PrefixTokenizer):
            return self.tokenizer.encode_within(text, add_special_tokens, INLINE_TEXT_CHARS)
        return None

    def special_tokens(self, namespace: Namespace, requested: Any, *, chat: bool) -> bool:
        """Whether the engine adds the tokenizer's special tokens (a BOS, for most models) to
        the text it tokenizes for a prompt of ``namespace``, a chat's rendered template when
        ``chat``, given the request's ``add_special_tokens`` (``requested``; None when absent).
        vLLM takes the request's value, true by default for ``/v1/completions`` and false for
        ``/v1/chat/completions`` (where true adds a BOS on top of the template's). SGLang has
        no such field: a text completion always gets them, a chat never (the rule when the
        model has replicas and every one is configured with an SGLang ``engine_hash``).
        InvalidArgumentError when ``requested`` is neither a bool nor None."""
        if requested is not None and not isinstance(requested, bool):
            raise InvalidArgumentError(
                f"'add_special_tokens' must be true or false, got {requested!r}"
            )
        engines = [
            r.engine_hash.engine if r.engine_hash is not None else "vllm"
            for r in self.config.replicas
            if r.namespace.model == namespace.model
        ]
        if engines and all(engine == "sglang" for engine in engines):
            return not chat
        return not chat if requested is None else requested

    def chat_text(self, messages: Any, **options: Any) -> str:
        """A conversation as the chat template renders it, with ``ChatTemplate.render``'s
        ``options`` (a neutral rendering without a template)."""
        template = self.chat_template
        flat = chat_messages(messages, template.content_format if template else "string")
        if template is None:
            return render_chat(flat)
        return template.render(flat, **options)

    def chat_tokens(
        self, messages: Any, *, add_special_tokens: bool = False, **options: Any
    ) -> TokenIds:
        """The token ids of a conversation: its ``chat_text`` (with ``options``) through the
        tokenizer, with the tokenizer's special tokens only when ``add_special_tokens`` (the
        template writes its own; see ``special_tokens``)."""
        text = self.chat_text(messages, **options)
        return self.tokens_of(None, text, add_special_tokens=add_special_tokens)

    def prompt(self, body: PromptBody, caller: Caller = ANONYMOUS) -> Prompt:
        """Namespace (under the caller's tenant salt) and token ids of a lookup or route body."""
        ns = body.namespace()
        salt = caller.salt(ns.salt)
        if salt != ns.salt:
            ns = dataclasses.replace(ns, salt=salt)
        if body.messages is not None:
            if body.tokens is not None or body.text is not None:
                raise InvalidArgumentError(
                    "give exactly one of 'tokens' (token ids), 'text' or 'messages'"
                )
            special = self.special_tokens(ns, body.add_special_tokens, chat=True)
            return Prompt(ns, self.chat_tokens(body.messages, add_special_tokens=special))
        special = body.text is not None and self.special_tokens(
            ns, body.add_special_tokens, chat=False
        )
        return Prompt(ns, self.tokens_of(body.tokens, body.text, add_special_tokens=special))

    def _lookup_body(self, body: PromptBody, caller: Caller = ANONYMOUS) -> PromptScores:
        """A lookup body's per-replica scores (and its namespace)."""
        prompt = self.prompt(body, caller)
        return self.router.lookup(prompt.namespace, prompt.tokens)

    def _route_body(
        self, body: RouteBody, caller: Caller = ANONYMOUS, routed_id: str | None = None
    ) -> RouteDecision:
        """Route a route body; ``routed_id`` (the caller's scoped id of its request id) counts
        as load until released."""
        prompt = self.prompt(body, caller)
        try:
            return self.route_tokens(prompt.namespace, prompt.tokens, routed_id)
        except DuplicateRequestError:  # in the caller's own words, not the scoped id
            raise DuplicateRequestError(
                f"request {body.request_id!r} is already in flight"
            ) from None

    async def lookup(self, body: PromptBody, caller: Caller) -> PromptScores:
        """A lookup body's scores, on the event loop or off it (``runs_inline``)."""
        result: PromptScores = await self._run(
            self.runs_inline(body), self._lookup_body, body, caller
        )
        return result

    async def route(self, body: RouteBody, caller: Caller) -> RouteDecision:
        """Route a route body within ``caller``'s limits, on the event loop or off it
        (``runs_inline``)."""
        inline = self.runs_inline(body)
        if body.request_id is None:
            routed: RouteDecision = await self._run(inline, self._route_body, body, caller)
            return routed
        routed_id = caller.scoped_id(body.request_id)
        self.limits.reserve(caller)
        settled: str | None = None
        try:
            decision: RouteDecision = await self._run(
                inline, self._route_body, body, caller, routed_id
            )
            settled = routed_id
        finally:
            self.limits.settle(caller, settled)
        if self.delivery.config.enabled:
            prediction = self.prediction(decision, body.adapter or body.model, caller)
            self.delivery.expect(routed_id, prediction)
        return decision

    async def release(
        self, request_id: str, caller: Caller, cached_tokens: int | None = None
    ) -> Released:
        """End the load of ``caller``'s ``request_id``; UnknownRequestError when that caller has
        no such request in flight (another key's request of that id is not its own).
        ``cached_tokens``: what the engine reported serving from its cache for it, checked
        against the route's prediction."""
        routed_id = caller.scoped_id(request_id)
        try:
            released: Released = await self._run(self.inline, self.router.release, routed_id)
        except UnknownRequestError:
            timeout = self.config.routing.in_flight_timeout_s
            ended = f" (or its load ended after {timeout:g} s)" if timeout else ""
            raise UnknownRequestError(f"request {request_id!r} is not in flight{ended}") from None
        self.limits.forget(caller, routed_id)
        self.delivery.report(routed_id, cached_tokens)
        return released._replace(request_id=request_id)

    def prediction(self, decision: RouteDecision, model: str, caller: Caller) -> Prediction:
        """What the route predicts for the engine's answer (``DeliveryCheck``); ``model`` as the
        request named it (a base model or an adapter)."""
        block_size = self._block_sizes.get(decision.replica)
        if block_size is None:  # added at run time
            spec = next((s for s in self.router.replicas() if s.name == decision.replica), None)
            block_size = spec.block_size if spec is not None else 0
        return Prediction(
            decision.replica,
            caller.tenant or "",
            model,
            block_size,
            decision.prompt_tokens,
            max((s.cached_tokens for s in decision.scores), default=0),
            decision.cached_tokens,
        )

    def route_tokens(
        self,
        namespace: Namespace,
        tokens: TokenIds,
        request_id: str | None,
        *,
        expire: bool = True,
    ) -> RouteDecision:
        """Route a prompt's tokens with the router and count the decision (``expire``: see
        ``Router.route``; the router checks the prompt-token limit)."""
        start = time.perf_counter()
        decision = self.router.route(namespace, tokens, request_id, expire=expire)
        self.metrics.observe_route(decision, time.perf_counter() - start)
        return decision

    def release_quietly(self, request_id: str) -> None:
        """Release a request the service routed itself; a second release is not an error."""
        with suppress(UnknownRequestError):
            self.router.release(request_id)
