"""A tiny OpenAI-compatible upstream for the proxy tests, serving several named replicas.

    python -m tests.fleet.service.fake_openai_upstream --port 8124

``POST /{name}/v1/completions`` and ``/{name}/v1/chat/completions`` answer as replica ``name``;
with ``"stream": true`` they send ``max_tokens`` server-sent events (``delay`` seconds apart when
the body has ``"delay"``) and ``data: [DONE]``; ``"wait"`` delays the answer itself, and
``"break_after": k`` cuts the connection after ``k`` events. With
``"stream_options": {"include_usage": true}`` a last chunk carries the ``usage``, whose
``prompt_tokens_details.cached_tokens`` is the body's ``"report_cached"`` (0 without it);
``"linger": s`` holds the stream open ``s`` seconds after ``data: [DONE]`` before it ends.
``GET /{name}/health`` answers as vLLM's does; ``GET /{name}/served`` counts the completion
requests replica ``name`` answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

app = FastAPI()
served: dict[str, int] = {}


async def _answer(name: str, kind: str, request: Request) -> Response:
    body = await request.json()
    served[name] = served.get(name, 0) + 1
    if body.get("wait"):  # a slow replica: nothing until then
        await asyncio.sleep(float(body["wait"]))
    count = int(body.get("max_tokens", 3))
    if not body.get("stream"):
        return JSONResponse(
            {"object": kind, "replica": name, "model": body.get("model"), "choices": [
                {"index": 0, "text": "x" * count}
            ]}
        )  # fmt: skip
    delay = float(body.get("delay", 0.0))

    broken = body.get("break_after")
    usage = (body.get("stream_options") or {}).get("include_usage")
    details = {"cached_tokens": int(body.get("report_cached", 0))}

    async def events() -> AsyncIterator[bytes]:
        for i in range(count):
            if i == broken:  # the replica dies mid-answer: the connection is cut
                raise RuntimeError("replica died")
            chunk = {"object": kind, "replica": name, "index": i}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if delay:
                await asyncio.sleep(delay)
        if usage:
            chunk = {"object": kind, "replica": name, "choices": [], "usage": {
                "prompt_tokens": 8, "completion_tokens": count, "total_tokens": 8 + count,
                "prompt_tokens_details": details,
            }}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        if body.get("linger"):  # the answer is over, the response not yet ended
            await asyncio.sleep(float(body["linger"]))

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/{name}/v1/completions")
async def completions(name: str, request: Request) -> Response:
    return await _answer(name, "text_completion", request)


@app.post("/{name}/v1/chat/completions")
async def chat(name: str, request: Request) -> Response:
    return await _answer(name, "chat.completion.chunk", request)


@app.get("/{name}/health")
async def replica_health(name: str) -> dict[str, str]:
    return {"status": "ok", "replica": name}


@app.get("/{name}/served")
async def replica_served(name: str) -> dict[str, int]:
    return {"served": served.get(name, 0)}


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
