"""Routing by prefix on real vLLM: a prompt that shares a prefix with an earlier one goes to the
replica that holds it, and the cached tokens vLLM reports equal the router's prediction, in full
blocks, on every request of a shared-prefix workload (token ids and text)."""

from __future__ import annotations

import random
from pathlib import Path

from real_fleet import BLOCK, as_text, full_blocks, random_tokens, serving

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall

SYSTEMS = 4
SYSTEM_BLOCKS = 6
REQUESTS = 32


def test_each_request_gets_the_cached_tokens_the_router_predicted(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    rng = random.Random(53)
    systems = [random_tokens(SYSTEM_BLOCKS * BLOCK) for _ in range(SYSTEMS)]
    seen: dict[int, str] = {}  # system prompt -> the replica that got it first
    delivery = {"min_requests": 20}
    with serving(tmp_path, list(fleet), vllm_install.model, delivery=delivery) as service:
        service.wait_probed([s.name for s in fleet])
        for i in range(REQUESTS):
            k = rng.randrange(SYSTEMS)
            prompt = systems[k] + random_tokens(rng.randrange(5, 3 * BLOCK))
            if len(prompt) % BLOCK == 0:
                prompt.append(5)
            predicted = service.lookup(prompt)
            replica, delivered = service.proxied(as_text(prompt) if i % 2 else prompt, max_tokens=3)
            assert delivered == min(predicted[replica], full_blocks(prompt)), (
                f"request {i} on {replica}: predicted {predicted}, vLLM reported {delivered}"
            )
            if k in seen:
                # the system prompt's replica holds it: the router sent the prompt there
                assert replica == seen[k], (i, predicted)
                assert delivered >= SYSTEM_BLOCKS * BLOCK
            else:
                seen[k] = replica
                assert delivered == 0
            service.barrier(fleet[replica])  # the next prediction sees this request's blocks
        assert len(set(seen.values())) == 2, "cold prompts are spread over both replicas"
        rows = service.replicas()
        stats = service.get("/v1/stats")
    for name, row in rows.items():
        assert not row["degraded"], row["degraded_reason"]
        window = row["delivery"]
        assert window["under_delivered"] == 0 and window["over_delivered"] == 0, (name, window)
    assert sum(r["delivery"]["requests"] for r in rows.values()) == REQUESTS
    (attribution,) = stats["attribution"]
    assert attribution["requests"] == REQUESTS and stats["unreported_requests"] == 0
    assert attribution["captured_tokens"] == attribution["delivered_tokens"] > 0
    assert attribution["available_tokens"] == attribution["captured_tokens"]
