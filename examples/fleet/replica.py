"""One replica of a fleet: the tiny random-weight runtime behind an OpenAI-style HTTP API.

The runtime of ``examples/tiny_runtime.py`` (a small GQA transformer whose K/V live in a
``PagedKVCache`` managed by a ``CacheManager(stepped=True)``) serves ``POST /v1/completions``
one request at a time. Every block the manager stores or evicts is published as a KV event on a
ZMQ PUB socket (with a replay socket for missed batches), one batch per step, as vLLM does with
``--kv-events-config``; a ``prefixcache serve`` router subscribes to them.

    python examples/fleet/replica.py --port 8100 --model tiny-random \\
        --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558

Endpoints:

- ``POST /v1/completions``: ``{"model", "prompt": token ids or text, "max_tokens"}``; the answer
  has the generated ``token_ids`` and ``text`` per choice and a ``usage`` with
  ``prompt_tokens``, ``completion_tokens`` and ``prompt_tokens_details.cached_tokens`` (prompt
  tokens served from the prefix cache, as vLLM reports them). Text is tokenized as UTF-8 bytes
  (the router's default tokenizer); generated ids below 256 are decoded the same way.
- ``GET /health``: 200 while serving, as vLLM and SGLang answer the router's health probe.
- ``GET /healthz``: status, model, block size, capacity and the bound ZMQ endpoints (binding
  ``tcp://127.0.0.1:*`` picks free ports; /healthz tells which).
- ``GET /stats``: requests, prompt and cached tokens, and the manager's block counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from prefixcache import Namespace
from prefixcache.errors import PrefixCacheError
from prefixcache.fleet.events.publisher import KVEventPublisher

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_runtime import ModelConfig, TinyDecoder, new_cache, run_requests

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
    ) -> None:
        self.model_name = model_name
        self.namespace = Namespace(model=model_name)
        self.model = TinyDecoder(ModelConfig(), seed=seed)
        self.mgr, self.kv = new_cache(
            self.model.cfg, num_blocks=num_blocks, block_size=block_size, stepped=True
        )
        self.publisher = KVEventPublisher(events, replay)
        self.publisher.attach(self.mgr)
        self.stats = ReplicaStats()
        self._lock = threading.Lock()  # the manager is not thread-safe: one request at a time

    def complete(self, prompt: list[int], max_tokens: int) -> Completion:
        """Prefill ``prompt`` over its cached prefix and decode ``max_tokens`` greedily."""
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
                self.namespace,
                {rid: prompt},
                max_new_tokens=max_tokens,
                backend="torch",
                after_step=self.publisher.flush,
            )
            done = Completion(rid, len(prompt), result.cached_tokens[rid], result.tokens[rid])
            self.stats.requests += 1
            self.stats.prompt_tokens += done.prompt_tokens
            self.stats.cached_tokens += done.cached_tokens
            self.stats.completion_tokens += len(done.token_ids)
        return done

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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": "BadRequest", "message": message, "status": status}}, status
    )


def create_app(replica: Replica) -> FastAPI:
    """The replica's HTTP API."""
    app = FastAPI(title="tiny replica", openapi_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        """An OpenAI-style completion, with vLLM's cached-token usage detail. The body is read
        as JSON whatever its Content-Type (``curl -d`` sends a form type), as vLLM reads it."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        return await run_in_threadpool(_complete, body)

    def _complete(body: dict[str, Any]) -> JSONResponse:
        try:
            if body.get("stream"):
                raise BadRequestError("streaming is not supported by this replica")
            model = body.get("model", replica.model_name)
            if model != replica.model_name:
                raise BadRequestError(f"this replica serves {replica.model_name!r}, not {model!r}")
            max_tokens = body.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise BadRequestError("max_tokens must be an integer")
            done = replica.complete(parse_prompt(body), max_tokens)
        except (BadRequestError, PrefixCacheError) as exc:
            return _error(400, str(exc))
        return JSONResponse(
            {
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
                "usage": {
                    "prompt_tokens": done.prompt_tokens,
                    "completion_tokens": len(done.token_ids),
                    "total_tokens": done.prompt_tokens + len(done.token_ids),
                    "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
                },
            }
        )

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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    replica = Replica(
        model_name=args.model,
        events=args.events,
        replay=args.replay,
        num_blocks=args.blocks,
        block_size=args.block_size,
        seed=args.seed,
    )
    try:
        uvicorn.run(create_app(replica), host=args.host, port=args.port, log_level="warning")
    finally:
        replica.close()


if __name__ == "__main__":
    main()
