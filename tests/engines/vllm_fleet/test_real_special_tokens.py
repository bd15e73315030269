"""A tokenizer that adds a BOS, as Llama 3's and Mistral's do, on real vLLM behind the proxy: text
completions (vLLM adds the BOS unless the request's ``add_special_tokens`` is false) and chat
(the template writes the BOS; vLLM adds another only when the request's ``add_special_tokens``
is true: it renders the template to text, then tokenizes that with the request's value). For
every request, the service's prompt has as many tokens as vLLM's ``usage.prompt_tokens`` and
the cached tokens routing predicted equal the ones vLLM delivered.

The server runs the tiny model with a variant of its tokenizer (``--tokenizer``), written here
from the model's own: ``<unk>``, ``<s>`` and ``</s>`` made special tokens, a post-processor
that puts ``<s>`` before every prompt, and a chat template that opens with ``{{ bos_token }}``.
The model folder itself is left as it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from real_fleet import (
    BLOCK,
    HTTP_TIMEOUT_S,
    MODEL,
    Service,
    as_text,
    bos_tokenizer,
    random_tokens,
    serving,
)

from prefixcache.engines.vllm import VLLMInstall, VLLMServer, free_port

HEAD_BLOCKS = 4


def _totals(service: Service) -> tuple[int, int, int, int]:
    """Requests, prompt tokens, captured (predicted) and delivered tokens the service has
    attributed so far."""
    rows = service.get("/v1/stats")["attribution"]
    if not rows:
        return 0, 0, 0, 0
    (row,) = rows
    return (
        row["requests"],
        row["prompt_tokens"],
        row["captured_tokens"],
        row["delivered_tokens"],
    )


def _capped(prompt_tokens: int, cached: int) -> int:
    """A prediction as the engine can report it: whole blocks before the last prompt token."""
    return min(cached, (prompt_tokens - 1) // BLOCK * BLOCK)


def test_text_and_chat_through_the_proxy_with_a_bos_adding_tokenizer(
    odd_server: Callable[..., VLLMServer], vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    variant = bos_tokenizer(vllm_install.model, tmp_path / "bos-tokenizer")
    server = odd_server(
        block_size=BLOCK,
        events=f"tcp://127.0.0.1:{free_port()}",
        extra_args=("--tokenizer", str(variant)),
    )

    def text(head: list[int], tail: list[int], **extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {"prompt": as_text(head + tail), **extra}

    def chat(head: list[int], tail: list[int], **extra: Any) -> tuple[str, dict[str, Any]]:
        messages = [
            {"role": "system", "content": as_text(head)},
            {"role": "user", "content": as_text(tail)},
        ]
        return "/v1/chat/completions", {"messages": messages, **extra}

    # (what, the request, tokens vLLM adds to the words of a text)
    cases: list[tuple[str, Callable[..., tuple[str, dict[str, Any]]], dict[str, Any], int]] = [
        ("text", text, {}, 1),
        ("text, add_special_tokens false", text, {"add_special_tokens": False}, 0),
        ("text, add_special_tokens true", text, {"add_special_tokens": True}, 1),
        ("chat", chat, {}, -1),
        ("chat, add_special_tokens true", chat, {"add_special_tokens": True}, -1),
        ("chat, add_special_tokens false", chat, {"add_special_tokens": False}, -1),
    ]
    chat_prompts: dict[str, int] = {}
    with serving(tmp_path / "service", [server], variant) as service:
        service.wait_probed([server.name])
        for what, build, extra, added in cases:
            head = random_tokens(HEAD_BLOCKS * BLOCK)  # a beginning of its own per case
            for turn, tail in enumerate((random_tokens(9), random_tokens(13))):
                path, body = build(head, tail, **extra)
                body.update(model=MODEL, max_tokens=1, temperature=0)
                before = _totals(service)
                answer = httpx.post(f"{service.url}{path}", json=body, timeout=HTTP_TIMEOUT_S)
                assert answer.status_code == 200, answer.text
                usage = answer.json()["usage"]
                delivered = usage["prompt_tokens_details"]["cached_tokens"]
                after = _totals(service)
                assert after[0] == before[0] + 1, what
                prompt = after[1] - before[1]
                assert prompt == usage["prompt_tokens"], (
                    f"{what}: the service's prompt has {prompt} tokens, vLLM's "
                    f"{usage['prompt_tokens']}"
                )
                predicted = _capped(prompt, after[2] - before[2])
                assert predicted == delivered, (
                    f"{what}, request {turn + 1}: routing predicted {predicted} cached tokens, "
                    f"vLLM delivered {delivered}"
                )
                if added >= 0:  # the variant really adds the BOS to a text, and only then
                    assert usage["prompt_tokens"] == len(head) + len(tail) + added, what
                elif turn == 0:
                    chat_prompts[what] = usage["prompt_tokens"]
                if turn == 1:
                    assert delivered >= HEAD_BLOCKS * BLOCK, what  # the shared beginning
                service.barrier(server)
        assert not service.replicas()[server.name]["degraded"]
    # the template's BOS in every chat, and the tokenizer's on top when the request asks for it
    plain = chat_prompts["chat"]
    assert chat_prompts == {
        "chat": plain,
        "chat, add_special_tokens true": plain + 1,
        "chat, add_special_tokens false": plain,
    }, chat_prompts
