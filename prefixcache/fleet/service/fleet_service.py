"""What the service's handlers share (``FleetService``): the router, the config, the tokenizer and
chat template that turn a request into token ids, the metrics, the optional ingest, and the HTTP
client of proxy mode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, NamedTuple

from fastapi import Request

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import TokenIds
from prefixcache.errors import InvalidArgumentError, PayloadTooLargeError, UnknownRequestError
from prefixcache.fleet.events.ingest import IngestSource
from prefixcache.fleet.router import PromptScores, RouteDecision, Router
from prefixcache.fleet.service.bodies import PromptBody, RouteBody
from prefixcache.fleet.service.metrics import ServiceMetrics
from prefixcache.fleet.service.settings import ServiceConfig
from prefixcache.text.chat_template import ChatTemplate, chat_messages
from prefixcache.text.tokenizers import Tokenizer, render_chat


class Prompt(NamedTuple):
    """A request's prompt: the namespace it belongs to and its token ids."""

    namespace: Namespace
    tokens: TokenIds


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
        *,
        ingest: IngestSource | None = None,
        proxying: bool = False,
    ) -> None:
        self.router = router
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.metrics = metrics
        self.ingest = ingest  # started and stopped with the app
        self.proxying = proxying  # the OpenAI-compatible endpoints forward to replicas
        self.urls = {r.name: r.url for r in config.replicas}
        self.http_client: Any = None  # httpx.AsyncClient while proxying
        self.started_at = time.time()  # the "created" of the models it lists

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

    def prompt(self, body: PromptBody) -> Prompt:
        """Namespace and token ids of a lookup or route body."""
        if body.messages is not None:
            if body.tokens is not None or body.text is not None:
                raise InvalidArgumentError(
                    "give exactly one of 'tokens' (token ids), 'text' or 'messages'"
                )
            return Prompt(body.namespace(), self.chat_tokens(body.messages))
        return Prompt(body.namespace(), self.tokens_of(body.tokens, body.text))

    def lookup(self, body: PromptBody) -> PromptScores:
        """A lookup body's per-replica scores (and its namespace)."""
        prompt = self.prompt(body)
        return self.router.lookup(prompt.namespace, prompt.tokens)

    def route_body(self, body: RouteBody) -> RouteDecision:
        """Route a route body (its request id counts as load until released)."""
        prompt = self.prompt(body)
        return self.route(prompt.namespace, prompt.tokens, body.request_id)

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
