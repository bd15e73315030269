"""``proxy.forward_token_ids`` against real vLLM: a text completion forwarded as the token ids the
service computed gets the answer vLLM gives the text itself. For each request, sent straight to
vLLM as text and through the service (forwarded as ids), under a ``cache_salt`` of each path's
own so that both meet the same cache state (first a miss, then a hit): the same completion text,
finish reason and usage, ``prompt_tokens``, ``completion_tokens`` and
``prompt_tokens_details.cached_tokens`` included. Text first seen, repeated and grown; with the
tokenizer's special tokens and without; JSON and streamed with usage; with the model's own
tokenizer and with one that adds a BOS to every prompt."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from real_fleet import (
    BLOCK,
    HTTP_TIMEOUT_S,
    MODEL,
    as_text,
    bos_tokenizer,
    random_tokens,
    serving,
)

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall, VLLMServer, free_port


def _answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """What matters of a completion's answer: its text, finish reason and usage (a stream's
    chunks joined, its usage chunk's)."""
    if not body.get("stream"):
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        (choice,) = data["choices"]
        return {"text": choice["text"], "finish": choice["finish_reason"], "usage": data["usage"]}
    text, finish, usage = "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as got:
        assert got.status_code == 200, got.read()
        for line in got.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices") or ():
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"text": text, "finish": finish, "usage": usage}


def _same_answers(service_url: str, server: VLLMServer, added: int) -> None:
    """Each case's requests straight and through the service agree (``added``: the special
    tokens vLLM adds to a text with its default ``add_special_tokens``)."""
    head = random_tokens(5 * BLOCK + 3)
    grown = head + random_tokens(2 * BLOCK)
    cases: list[tuple[str, list[int], dict[str, Any], int]] = [
        ("first sight", head, {}, added),
        ("repeat", head, {}, added),
        ("grown", grown, {}, added),
        ("no special tokens", grown, {"add_special_tokens": False}, 0),
        ("streamed", grown, {"stream": True, "stream_options": {"include_usage": True}}, added),
    ]
    salts = {"straight": secrets.token_hex(6), "proxied": secrets.token_hex(6)}
    for what, words, extra, bos in cases:
        body = {"model": MODEL, "prompt": as_text(words), "max_tokens": 6, "temperature": 0}
        body.update(extra)
        straight = _answer(server.url, {**body, "cache_salt": salts["straight"]})
        proxied = _answer(service_url, {**body, "cache_salt": salts["proxied"]})
        assert proxied == straight, f"{what}: through the service {proxied}, straight {straight}"
        assert straight["usage"]["prompt_tokens"] == len(words) + bos, what
        cached = straight["usage"]["prompt_tokens_details"]["cached_tokens"]
        if what in ("repeat", "grown", "streamed"):  # blocks of the requests before
            assert cached >= 5 * BLOCK, what


def test_forwarded_token_ids_get_the_answers_of_the_text(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    server = fleet["vllm-0"]
    proxy = {"forward_token_ids": True}
    with serving(tmp_path, [server], vllm_install.model, proxy=proxy) as service:
        service.wait_probed([server.name])
        _same_answers(service.url, server, added=0)


def test_forwarded_token_ids_with_a_bos_adding_tokenizer(
    odd_server: Callable[..., VLLMServer], vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    variant = bos_tokenizer(vllm_install.model, tmp_path / "bos-tokenizer")
    server = odd_server(
        block_size=BLOCK,
        events=f"tcp://127.0.0.1:{free_port()}",
        extra_args=("--tokenizer", str(variant)),
    )
    proxy = {"forward_token_ids": True}
    with serving(tmp_path / "service", [server], variant, proxy=proxy) as service:
        service.wait_probed([server.name])
        _same_answers(service.url, server, added=1)
