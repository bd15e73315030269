"""One replica of a fleet: the tiny random-weight runtime behind an OpenAI-style HTTP API.

The runtime of ``examples/tiny_runtime.py`` (a small GQA transformer whose K/V live in a
``PagedKVCache`` managed by a ``CacheManager(stepped=True)``) serves ``POST /v1/completions``
one request at a time. Every block the manager stores or evicts is published as a KV event on a
ZMQ PUB socket (with a replay socket for missed batches), one batch per step, as vLLM does with
``--kv-events-config``; a ``prefixcache serve`` router subscribes to them.

    python examples/fleet/replica.py --port 8100 --model tiny-random \\
        --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558

Endpoints:

- ``POST /v1/completions``: ``{"model", "prompt": token ids or text, "max_tokens",
  "cache_salt"}``; the answer has the generated ``token_ids`` and ``text`` per choice and a
  ``usage`` with ``prompt_tokens``, ``completion_tokens`` and
  ``prompt_tokens_details.cached_tokens``. Text is tokenized as UTF-8 bytes (the router's default
  tokenizer); generated ids below 256 are decoded the same way.
  With ``"stream": true`` the answer is ``text/event-stream``: one ``text_completion`` chunk
  per generated token, a last chunk with the ``finish_reason`` (and the ``usage`` when
  ``stream_options.include_usage`` is set), then ``data: [DONE]``, as vLLM streams. The cache
  work is the same; the tokens are decoded first and then streamed.
- ``POST /v1/chat/completions``: ``{"model", "messages", "max_tokens"}``, streamed or not, in
  OpenAI's chat format (``chat.completion``, or ``chat.completion.chunk`` with ``delta``). The
  messages are rendered as ``prefixcache serve`` renders them without a ``chat_template`` (the
  neutral rendering of ``prefixcache.text``) and tokenized as UTF-8 bytes, so the blocks this
  replica caches are the ones the router computes for the conversation.
- ``GET /health``: 200 while serving, as vLLM and SGLang answer the router's health probe.
- ``GET /healthz``: status, model, block size, capacity and the bound ZMQ endpoints (binding
  ``tcp://127.0.0.1:*`` picks free ports; /healthz tells which).
- ``GET /stats``: requests, prompt and cached tokens, and the manager's block counts.
- ``POST /held``: ``{"prompt": token ids or text, "cache_salt"}``: how many leading full blocks
  of the prompt this replica's cache holds now (changing nothing), the truth a router's index is
  checked against.

Its prefix cache behaves as vLLM's where a router relies on it: a request's ``cache_salt`` keys
its blocks apart from every other salt's (announced in the KV events as vLLM announces it, on the
first block of a chain), only full blocks are reused (no partial-block copy), and
``cached_tokens`` counts whole blocks, the last prompt token always computed
(``tests/engines/vllm_fleet/test_example_replica_parity.py`` compares the two on the same
prompts).

With ``--engine-hash vllm-sha256_cbor`` (or another of vLLM's algorithms, or ``sglang-sha256``)
the events carry the block hashes that engine would compute for the same tokens instead of
prefixcache's digests, as a vLLM replica does; a router told the same ``engine_hash`` can then
find blocks stored under a parent it never saw.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache import CacheManager, Namespace
from prefixcache.errors import PrefixCacheError
from prefixcache.fleet.events.engine_keys import EngineHasher, parse_engine_hash
from prefixcache.fleet.events.publisher import KVEventPublisher
from prefixcache.fleet.events.wire import WireAllBlocksCleared, WireBlockRemoved, WireBlockStored
from prefixcache.kv_cache import PagedKVCache
from prefixcache.manager.block_events import BlockStored, CacheEvent
from prefixcache.text.chat_template import chat_messages
from prefixcache.text.tokenizers import render_chat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_runtime import ModelConfig, TinyDecoder, run_requests

MAX_TOKENS_LIMIT = 256


class BadRequestError(ValueError):
    """The request body does not describe a completion this replica can run."""


@dataclass(frozen=True)
class Completion:
    """One finished completion."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    token_ids: list[int]


@dataclass
class ReplicaStats:
    """Running totals since the replica started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def decode_text(token_ids: list[int]) -> str:
    """Generated ids as text: ids below 256 are UTF-8 bytes, the others are dropped."""
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class EngineKeyedPublisher(KVEventPublisher):
    """Publishes a manager's events with an engine's block hashes in place of prefixcache's
    digests, keeping each cached block's engine digest until the block leaves the cache."""

    def __init__(self, hasher: EngineHasher, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hasher = hasher
        self._engine: dict[bytes, bytes] = {}  # prefixcache digest -> engine digest

    def on_event(self, event: CacheEvent) -> None:
        """Queue the event, its hashes in the engine's form."""
        super().on_event(event)
        wire = self._pending[-1]
        form, engine = self.hasher.event_form, self._engine
        if isinstance(wire, WireBlockStored) and isinstance(event, BlockStored):
            parent = None if wire.parent_block_hash is None else engine[wire.parent_block_hash]
            salt = event.namespace.salt  # the engine hashes it into a chain's first block
            digests = self.hasher.digests(wire.token_ids, parent=parent, salt=salt)
            engine.update(zip(wire.block_hashes, digests, strict=True))
            wire.parent_block_hash = None if parent is None else form(parent)
            wire.block_hashes = [form(d) for d in digests]
        elif isinstance(wire, WireBlockRemoved):
            wire.block_hashes = [form(engine.pop(h)) for h in wire.block_hashes]
        elif isinstance(wire, WireAllBlocksCleared):
            engine.clear()


class Replica:
    """The runtime, its cache and its event publisher; ``complete`` runs one request."""

    def __init__(
        self,
        *,
        model_name: str,
        events: str,
        replay: str | None,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        engine_hash: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        self.model_name = model_name
        self.namespace = Namespace(model=model_name)
        self.model = TinyDecoder(ModelConfig(), seed=seed)
        cfg = self.model.cfg
        # full blocks only, as vLLM reuses them: no copy of a partially matching block
        self.mgr = CacheManager(num_blocks, block_size, stepped=True, partial_copy=False)
        self.kv = PagedKVCache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=torch.float32,
        )  # fmt: skip
        spec = parse_engine_hash(engine_hash, "--engine-hash")
        self.publisher = (
            KVEventPublisher(events, replay, buffer_steps=buffer_steps)
            if spec is None
            else EngineKeyedPublisher(
                EngineHasher(spec, block_size), events, replay, buffer_steps=buffer_steps
            )
        )
        self.publisher.attach(self.mgr)
        self.stats = ReplicaStats()
        self._lock = threading.Lock()  # the manager is not thread-safe: one request at a time

    def namespace_of(self, salt: str | None) -> Namespace:
        """The namespace a request's blocks live in: its ``cache_salt``'s (none when empty)."""
        return self.namespace if not salt else Namespace(model=self.model_name, salt=salt)

    def complete(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> Completion:
        """Prefill ``prompt`` over its cached prefix (under ``salt``) and decode ``max_tokens``
        greedily. The cached tokens reported are whole blocks, as vLLM reports them: a prompt
        cached whole computes its last token in a copy of its last block, which vLLM counts
        as computed."""
        vocab = self.model.cfg.vocab
        if not prompt or not all(0 <= t < vocab for t in prompt):
            raise BadRequestError(f"the prompt must be a non-empty list of ids in [0, {vocab})")
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequestError(f"max_tokens must be in 1..{MAX_TOKENS_LIMIT}")
        rid = f"cmpl-{uuid.uuid4().hex}"
        with self._lock:
            if (len(prompt) + max_tokens) > self.mgr.num_blocks * self.mgr.block_size:
                raise BadRequestError("prompt and max_tokens do not fit in this replica's cache")
            result = run_requests(
                self.model,
                self.mgr,
                self.kv,
                self.namespace_of(salt),
                {rid: prompt},
                max_new_tokens=max_tokens,
                backend="torch",
                after_step=self.publisher.flush,
            )
            p = self.mgr.block_size
            cached = result.cached_tokens[rid] // p * p
            done = Completion(rid, len(prompt), cached, result.tokens[rid])
            self.stats.requests += 1
            self.stats.prompt_tokens += done.prompt_tokens
            self.stats.cached_tokens += done.cached_tokens
            self.stats.completion_tokens += len(done.token_ids)
        return done

    def held_blocks(self, prompt: list[int], salt: str | None = None) -> int:
        """The leading full blocks of ``prompt`` (under ``salt``) the cache holds now."""
        with self._lock:
            return self.mgr.lookup(prompt, self.namespace_of(salt)).cached_blocks

    def snapshot(self) -> dict[str, Any]:
        """Counters and block counts, for /stats."""
        with self._lock:
            counts = self.mgr.block_counts()
            return {
                **asdict(self.stats),
                "blocks": {"free": counts.free, "active": counts.active, "cached": counts.cached},
                "evicted_blocks": self.mgr.stats.evicted_blocks,
                "events_published": self.publisher.next_seq,
            }

    def close(self) -> None:
        """Close the event sockets."""
        with self._lock:
            self.publisher.close()


def parse_prompt(body: dict[str, Any]) -> list[int]:
    """The prompt of a completion body as token ids (text: UTF-8 bytes)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return list(prompt.encode("utf-8"))
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt
    raise BadRequestError("'prompt' must be a string or a list of token ids (one prompt)")


def parse_salt(body: dict[str, Any]) -> str | None:
    """The body's ``cache_salt``: a string, or none."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequestError("'cache_salt' must be a string")
    return salt


def parse_messages(body: dict[str, Any]) -> list[int]:
    """The messages of a chat body as token ids: rendered as the service renders a conversation
    without a chat template, then UTF-8 bytes (the service's default tokenizer)."""
    text = render_chat(chat_messages(body.get("messages")))
    return list(text.encode("utf-8"))


def token_texts(token_ids: list[int]) -> Iterator[str]:
    """The text each generated id adds, decoded incrementally as ``decode_text`` decodes them
    all (a character split over several byte ids comes with its last one)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        yield decoder.decode(bytes([t]) if t < 256 else b"", final=last)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": "BadRequest", "message": message, "status": status}}, status
    )


def _usage(done: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": len(done.token_ids),
        "total_tokens": done.prompt_tokens + len(done.token_ids),
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequestError("'stream_options' must be an object with a boolean include_usage")
    return bool(options.get("include_usage", False))


def create_app(replica: Replica) -> FastAPI:
    """The replica's HTTP API."""
    app = FastAPI(title="tiny replica", openapi_url=None)

    async def read_json(request: Request) -> dict[str, Any] | JSONResponse:
        """The body as a JSON object whatever its Content-Type (``curl -d`` sends a form
        type), as vLLM reads it; or the 400 to answer."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        return body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """An OpenAI-style completion, with vLLM's cached-token usage detail, streamed or not."""
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        return await run_in_threadpool(_serve, body, parse_prompt, _completion, _completion_chunks)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """An OpenAI-style chat completion, streamed or not."""
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        return await run_in_threadpool(_serve, body, parse_messages, _chat, _chat_chunks)

    def _serve(
        body: dict[str, Any],
        prompt_of: Callable[[dict[str, Any]], list[int]],
        answer: Callable[[Completion], dict[str, Any]],
        chunks: Callable[[Completion, bool], Iterator[dict[str, Any]]],
    ) -> Response:
        """Check the body, run the request, and answer as one JSON or as server-sent events."""
        try:
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequestError("'stream' must be true or false")
            include_usage = _include_usage(body) if stream else False
            model = body.get("model", replica.model_name)
            if model != replica.model_name:
                raise BadRequestError(f"this replica serves {replica.model_name!r}, not {model!r}")
            max_tokens = body.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise BadRequestError("max_tokens must be an integer")
            done = replica.complete(prompt_of(body), max_tokens, parse_salt(body))
        except (BadRequestError, PrefixCacheError) as exc:
            return _error(400, str(exc))
        if not stream:
            return JSONResponse(answer(done))
        return StreamingResponse(
            _events(chunks(done, include_usage)), media_type="text/event-stream"
        )

    def _events(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
        for chunk in chunks:
            yield _sse(chunk)
        yield "data: [DONE]\n\n"

    def _completion(done: Completion) -> dict[str, Any]:
        return {
            "id": done.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": replica.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": decode_text(done.token_ids),
                    "token_ids": done.token_ids,
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": _usage(done),
        }

    def _completion_chunks(done: Completion, include_usage: bool) -> Iterator[dict[str, Any]]:
        head = {
            "id": done.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": replica.model_name,
        }
        for token, text in zip(done.token_ids, token_texts(done.token_ids), strict=True):
            choice = {"index": 0, "text": text, "token_ids": [token], "logprobs": None}
            yield {**head, "choices": [{**choice, "finish_reason": None}]}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        yield {**head, "choices": [last], **({"usage": _usage(done)} if include_usage else {})}

    def _chat(done: Completion) -> dict[str, Any]:
        return {
            "id": done.request_id.replace("cmpl-", "chatcmpl-", 1),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": replica.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": decode_text(done.token_ids)},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": _usage(done),
        }

    def _chat_chunks(done: Completion, include_usage: bool) -> Iterator[dict[str, Any]]:
        head = {
            "id": done.request_id.replace("cmpl-", "chatcmpl-", 1),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": replica.model_name,
        }
        first = {"role": "assistant", "content": ""}
        yield {**head, "choices": [{"index": 0, "delta": first, "finish_reason": None}]}
        for text in token_texts(done.token_ids):
            delta = {"content": text}
            yield {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        last = {"index": 0, "delta": {}, "finish_reason": "length"}
        yield {**head, "choices": [last], **({"usage": _usage(done)} if include_usage else {})}

    @app.get("/health")
    def health() -> Response:
        """Readiness as vLLM and SGLang answer it (the router's health probe): 200, no body."""
        return Response(status_code=200)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Liveness, and where the KV events are published."""
        return {
            "status": "ok",
            "model": replica.model_name,
            "block_size": replica.mgr.block_size,
            "capacity_blocks": replica.mgr.num_blocks,
            "events": replica.publisher.endpoint,
            "replay": replica.publisher.replay_endpoint,
        }

    @app.post("/held")
    async def held(request: Request) -> Response:
        """How many leading full blocks of the prompt the cache holds."""
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            blocks = replica.held_blocks(parse_prompt(body), parse_salt(body))
        except (BadRequestError, PrefixCacheError) as exc:
            return _error(400, str(exc))
        return JSONResponse({"blocks": blocks})

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        """Cache hit counters since start."""
        return replica.snapshot()

    return app


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="tiny-random", help="the served model name")
    parser.add_argument("--events", default="tcp://127.0.0.1:*", help="ZMQ PUB endpoint")
    parser.add_argument("--replay", default="tcp://127.0.0.1:*", help="ZMQ replay endpoint")
    parser.add_argument("--blocks", type=int, default=256, help="KV cache capacity in blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="weights seed (same on every replica)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--engine-hash", help="publish this engine's block hashes, e.g. vllm-sha256_cbor"
    )
    parser.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer batches")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    replica = Replica(
        model_name=args.model,
        events=args.events,
        replay=args.replay,
        num_blocks=args.blocks,
        block_size=args.block_size,
        seed=args.seed,
        engine_hash=args.engine_hash,
        buffer_steps=args.buffer_steps,
    )
    try:
        uvicorn.run(create_app(replica), host=args.host, port=args.port, log_level="warning")
    finally:
        replica.close()


if __name__ == "__main__":
    main()
