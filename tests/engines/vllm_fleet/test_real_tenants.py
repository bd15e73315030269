"""Tenants on real vLLM: two API keys send the same prompts; the service forwards each key's
tenant salt as ``cache_salt``, vLLM's own cache keeps the tenants apart, every prediction holds,
no replica goes degraded, and the attribution sums hold per tenant."""

from __future__ import annotations

import random
from pathlib import Path

from real_fleet import (
    ACME,
    BLOCK,
    GLOBEX,
    as_text,
    engine_cached,
    full_blocks,
    random_tokens,
    serving,
)

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall

TENANTS = {ACME: "acme", GLOBEX: "globex"}
REQUESTS = 48


def test_two_tenants_share_prefixes_only_within_their_own_cache(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    rng = random.Random(7)
    systems = [random_tokens(5 * BLOCK) for _ in range(3)]
    first_seen: dict[tuple[str, int], str] = {}
    delivery = {"min_requests": 20}
    with serving(tmp_path, list(fleet), vllm_install.model, keys=True, delivery=delivery) as svc:
        svc.wait_probed([s.name for s in fleet])
        for i in range(REQUESTS):
            key = (ACME, GLOBEX)[i % 2]
            k = rng.randrange(len(systems))
            prompt = systems[k] + random_tokens(rng.randrange(3, 2 * BLOCK))
            if len(prompt) % BLOCK == 0:
                prompt.append(7)
            predicted = svc.lookup(prompt, key=key)  # within the key's tenant
            replica, delivered = svc.proxied(as_text(prompt) if i % 3 else prompt, key)
            assert delivered == min(predicted[replica], full_blocks(prompt)), (i, predicted)
            tenant = TENANTS[key]
            if (tenant, k) not in first_seen:
                # the other tenant may have sent this system prompt: never a hit across
                first_seen[tenant, k] = replica
                assert delivered == 0, (i, tenant, replica)
            else:
                assert delivered >= 5 * BLOCK
            svc.wait_held(fleet[replica], prompt, salt=f"tenant:{tenant}")
        # vLLM keyed the blocks under the forwarded salt: straight to the engine, only that
        # salt hits them
        (tenant, k), replica = next(iter(first_seen.items()))
        probe = systems[k] + random_tokens(9)
        server = fleet[replica]
        assert engine_cached(server, probe, salt=f"tenant:{tenant}") == 5 * BLOCK
        assert engine_cached(server, probe) == 0
        assert engine_cached(server, probe, salt="tenant:nobody") == 0
        rows = svc.replicas()
        stats = svc.get("/v1/stats")
        own = svc.get("/v1/stats", key=ACME)
    assert not [r["degraded_reason"] for r in rows.values() if r["degraded"]]
    assert all(r["delivery"]["under_delivered"] == 0 for r in rows.values())
    assert all(r["delivery"]["over_delivered"] == 0 for r in rows.values())
    by_tenant = {row["tenant"]: row for row in stats["attribution"]}
    assert set(by_tenant) == {"acme", "globex"} and stats["unreported_requests"] == 0
    for row in by_tenant.values():
        assert row["requests"] == REQUESTS // 2
        assert row["prompt_tokens"] >= row["available_tokens"] >= row["captured_tokens"]
        assert row["captured_tokens"] >= row["delivered_tokens"] > 0
    assert [row["tenant"] for row in own["attribution"]] == ["acme"]
