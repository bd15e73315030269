"""The fleet index against vLLM's own caches: after stores, after ``/reset_prefix_cache``, after
a replica restarts (it comes back empty) and after the router restarts (it learns the caches
again from the engines' replay endpoints), the cached tokens the index predicts for a prompt on
a replica equal what that engine serves when sent the prompt."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from real_fleet import BLOCK, engine_cached, full_blocks, random_tokens, serving, wait_for

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall


def _workload(seed: int, systems: int = 3, requests: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [random_tokens(rng.randrange(3, 7) * BLOCK) for _ in range(systems)]
    return [heads[i % systems] + random_tokens(rng.randrange(3, 40)) for i in range(requests)]


def test_the_index_holds_what_each_engine_caches_and_forgets_a_reset(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    prompts = _workload(1)
    with serving(tmp_path, list(fleet), vllm_install.model) as service:
        service.wait_probed([s.name for s in fleet])
        for tokens in prompts:
            replica, _ = service.proxied(tokens, max_tokens=4)
            service.wait_held(fleet[replica], tokens)
        # every prompt on every replica, the ones it never got included
        assert service.check_index(list(fleet), prompts) > 0
        # vLLM's reset empties its cache and announces it (AllBlocksCleared)
        first = fleet["vllm-0"]
        httpx.post(f"{first.url}/reset_prefix_cache", timeout=60).raise_for_status()
        service.barrier(first)
        assert all(service.lookup(p)["vllm-0"] == 0 for p in prompts)
        assert engine_cached(first, prompts[0]) == 0
        service.wait_held(first, prompts[0])
        service.check_index([first], prompts)


def test_a_restarted_router_learns_the_engines_caches_again(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    prompts = _workload(2)
    servers = list(fleet)
    with serving(tmp_path / "first", servers, vllm_install.model) as service:
        service.wait_probed([s.name for s in servers])
        for tokens in prompts:
            replica, _ = service.proxied(tokens, max_tokens=4)
            service.wait_held(fleet[replica], tokens)
        held = {s.name: [service.lookup(p)[s.name] for p in prompts] for s in servers}
    # a new router knows nothing; the engines' next batches show it the gap, and their replay
    # endpoints give it every batch it missed
    with serving(tmp_path / "second", servers, vllm_install.model) as service:
        service.wait_probed([s.name for s in servers])
        for server in servers:
            service.barrier(server)
            assert [service.lookup(p)[server.name] for p in prompts] == held[server.name]
        service.check_index(servers, prompts)


def test_a_restarted_replica_is_routed_as_the_empty_engine_it_is(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    restarted = fleet["vllm-1"]
    system = random_tokens(6 * BLOCK)
    with serving(tmp_path, list(fleet), vllm_install.model) as service:
        service.wait_probed([s.name for s in fleet])
        first = system + random_tokens(9)
        assert engine_cached(restarted, first) == 0
        service.wait_held(restarted, first)
        assert service.lookup(first)["vllm-1"] == 6 * BLOCK
        restarted = fleet.restart("vllm-1")  # the same ports, an empty cache
        wait_for(lambda: service.replicas()["vllm-1"]["up"], "vllm-1 up again")
        prompt = system + random_tokens(11)
        predicted = service.lookup(prompt)
        replica, delivered = service.proxied(prompt)
        assert predicted["vllm-1"] == 0, f"the index kept vllm-1's blocks: {predicted}"
        assert delivered == min(predicted[replica], full_blocks(prompt)), (predicted, replica)
        service.wait_held(fleet[replica], prompt)
        service.check_index(list(fleet), [first, prompt])
