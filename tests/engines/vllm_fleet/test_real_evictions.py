"""Evictions on real vLLM: a server with a KV cache of 48 blocks evicts all the time under a
shared-prefix workload; the index follows its removals, so the cached tokens it predicts for any
prompt equal what the engine serves, request after request."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import httpx
from real_fleet import BLOCK, full_blocks, random_tokens, serving

from prefixcache.engines.vllm import VLLMInstall, VLLMServer, free_port

KV_BLOCKS = 48


def _removed(service_url: str, name: str) -> int:
    text = httpx.get(f"{service_url}/metrics", timeout=30).text
    found = re.search(
        rf'prefixcache_ingest_blocks_removed_total{{replica="{name}"}} (\d+(?:\.\d+)?)', text
    )
    return int(float(found.group(1))) if found else 0


def test_the_index_follows_a_small_cache_through_its_evictions(
    odd_server: Callable[..., VLLMServer], vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    server = odd_server(
        block_size=BLOCK,
        kv_cache_bytes=KV_BLOCKS * BLOCK * 2048,  # 2 KiB a token: 2 layers, K and V, fp32
        max_model_len=1024,
        events=f"tcp://127.0.0.1:{free_port()}",
    )
    assert server.num_gpu_blocks() == KV_BLOCKS
    rng = random.Random(3)
    heads = [random_tokens(4 * BLOCK) for _ in range(8)]
    prompts = [heads[rng.randrange(8)] + random_tokens(rng.randrange(40, 120)) for _ in range(32)]
    with serving(tmp_path, [server], vllm_install.model) as service:
        service.wait_probed([server.name])
        for i, tokens in enumerate(prompts):
            predicted = min(service.lookup(tokens)[server.name], full_blocks(tokens))
            _, delivered = service.proxied(tokens, max_tokens=8)
            assert delivered == predicted, f"request {i}: predicted {predicted}, got {delivered}"
            service.wait_held(server, tokens)
        assert _removed(service.url, server.name) > KV_BLOCKS  # it evicted, many times over
        service.check_index([server], list(reversed(prompts)))
        row = service.replicas()[server.name]
    assert row["index_blocks"] <= KV_BLOCKS
    assert not row["degraded"], row["degraded_reason"]
