"""The OpenAI client, as users call it, through the service's proxy to real vLLM: plain and chat
completions, streamed with usage and not. Each answer's cached tokens are vLLM's, equal to what
routing predicted; a conversation's next turn goes to the replica that cached its earlier ones;
the service reads the figure of every answer, streams closed right after ``[DONE]`` included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
from real_fleet import BLOCK, MODEL, as_text, full_blocks, random_tokens, serving

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall

STREAMS = 12


def _cached(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


def test_the_openai_client_through_the_proxy(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    system = random_tokens(5 * BLOCK)
    with serving(tmp_path, list(fleet), vllm_install.model) as service:
        service.wait_probed([s.name for s in fleet])
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
        sent = 0
        # plain completions, text: the repeat of a prefix gets its full blocks from the cache
        first = system + random_tokens(7)
        answer = client.completions.with_raw_response.create(
            model=MODEL, prompt=as_text(first), max_tokens=4, temperature=0
        )
        home = answer.headers["x-prefixcache-replica"]
        assert _cached(answer.parse().usage) == 0
        service.wait_held(fleet[home], first)
        second = system + random_tokens(9)
        predicted = service.lookup(second)
        answer = client.completions.with_raw_response.create(
            model=MODEL, prompt=as_text(second), max_tokens=4, temperature=0
        )
        assert answer.headers["x-prefixcache-replica"] == home
        assert _cached(answer.parse().usage) == min(predicted[home], full_blocks(second))
        assert predicted[home] >= 5 * BLOCK
        sent += 2
        service.wait_held(fleet[home], second)
        # streamed completions with usage: the last chunk carries vLLM's cached tokens; the
        # client stops reading at [DONE] and closes
        for i in range(STREAMS):
            prompt = system + random_tokens(5 + i)
            predicted = service.lookup(prompt)
            stream = client.completions.create(
                model=MODEL,
                prompt=as_text(prompt),
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            with stream:
                for chunk in stream:
                    usage = chunk.usage or usage
            assert usage is not None and usage.prompt_tokens == len(prompt)
            assert _cached(usage) == min(predicted[home], full_blocks(prompt)), i
            service.wait_held(fleet[home], prompt)
        sent += STREAMS
        # chat: a conversation's second turn, streamed, comes back to the first turn's replica
        messages: list[dict[str, str]] = [
            {"role": "system", "content": as_text(random_tokens(4 * BLOCK))},
            {"role": "user", "content": as_text(random_tokens(20))},
        ]
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0
        )
        chat_home = reply.headers["x-prefixcache-replica"]
        parsed = reply.parse()
        assert _cached(parsed.usage) == 0
        turn = parsed.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": turn},
            {"role": "user", "content": as_text(random_tokens(15))},
        ]
        service.barrier(fleet[chat_home])
        predicted_chat = service.lookup_messages(messages)
        stream = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert stream.headers["x-prefixcache-replica"] == chat_home
        usage = None
        with stream.parse() as chunks:
            for chunk in chunks:
                usage = chunk.usage or usage
        assert usage is not None and _cached(usage) >= 4 * BLOCK
        whole = (usage.prompt_tokens - 1) // BLOCK * BLOCK  # the engine computes the last
        assert _cached(usage) == min(predicted_chat[chat_home], whole)
        sent += 2
        stats = service.get("/v1/stats")
        rows = service.replicas()
    (row,) = stats["attribution"]
    assert row["requests"] == sent and stats["unreported_requests"] == 0
    assert row["captured_tokens"] == row["delivered_tokens"]
    assert not any(r["degraded"] for r in rows.values())
