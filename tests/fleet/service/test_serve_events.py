"""`prefixcache serve` fed by real KV events: two replicas' managers publish over ZMQ, the
service (a real subprocess on the in-memory index) subscribes, and its lookups and routes follow
what the replicas cache, evict and clear."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from prefixcache import Namespace
from tests.fleet.fleet_processes import PublishingReplica, running, write_fleet_config
from tests.fleet_support import free_port, wait_until

MODEL = "tiny-model"
BLOCK = 4
SYSTEM = list(range(100, 132))  # 8 full blocks
OTHER = list(range(500, 532))


@pytest.fixture(params=["memory", "redis"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    index = "memory"
    if request.param == "redis":
        index = request.getfixturevalue("redis_server").url
    replicas = {"a": PublishingReplica(64, MODEL, BLOCK), "b": PublishingReplica(12, MODEL, BLOCK)}
    path = write_fleet_config(tmp_path / "fleet.yaml", replicas, index, {"policy": "prefix"})
    port = free_port()
    args = ["prefixcache", "serve", "--config", str(path), "--port", str(port)]
    try:
        with running(args, port, tmp_path / "serve.log") as base, httpx.Client(base_url=base) as c:
            yield {"client": c, "replicas": replicas, "index": request.param}
    finally:
        for rep in replicas.values():
            rep.publisher.close()


def cached(client: httpx.Client, tokens: list[int]) -> dict[str, int]:
    body = client.post("/v1/lookup", json={"model": MODEL, "tokens": tokens}).json()
    return {s["name"]: s["cached_tokens"] for s in body["replicas"]}


def test_lookups_follow_the_replicas_events(fleet: dict[str, Any]) -> None:
    client, reps = fleet["client"], fleet["replicas"]
    prompt = [*SYSTEM, 1, 2, 3]
    # the subscriber connects after the service starts: publish until the first batch lands
    wait_until(
        lambda: reps["a"].serve(prompt) or cached(client, prompt)["a"] == len(SYSTEM),
        "replica a's blocks in the index",
    )
    assert cached(client, prompt) == {"a": len(SYSTEM), "b": 0}
    route = client.post("/v1/route", json={"model": MODEL, "tokens": prompt}).json()
    assert route["replica"] == "a" and route["cached_tokens"] == len(SYSTEM)

    # b caches another prompt; its small pool then evicts it: the index follows both
    wait_until(
        lambda: reps["b"].serve(OTHER) or cached(client, OTHER)["b"] == len(OTHER),
        "replica b's blocks in the index",
    )
    reps["b"].serve(list(range(900, 948)))  # 12 blocks: evicts all of OTHER from b
    wait_until(lambda: cached(client, OTHER)["b"] == 0, "b's evictions in the index")
    assert cached(client, prompt)["a"] == len(SYSTEM)

    # a restarts its cache: AllBlocksCleared empties exactly a's holdings
    reps["a"].mgr.reset()
    reps["a"].publisher.flush()
    wait_until(lambda: cached(client, prompt)["a"] == 0, "a's reset in the index")
    assert cached(client, list(range(900, 948)))["b"] == 48

    metrics = client.get("/metrics").text
    stored = {
        m["replica"]: float(m["value"])
        for m in re.finditer(
            r'prefixcache_ingest_blocks_stored_total\{replica="(?P<replica>\w+)"\} (?P<value>\S+)',
            metrics,
        )
    }
    assert stored["a"] >= len(SYSTEM) // BLOCK and stored["b"] >= 18
    if fleet["index"] == "redis":  # a shared index reports its health
        assert re.search(r"^prefixcache_index_in_sync 1\.0$", metrics, re.M)
        assert re.search(r"^prefixcache_index_errors_total 0\.0$", metrics, re.M)


def test_text_prompts_use_the_configured_tokenizer_file(tmp_path: Path) -> None:
    """With ``tokenizer:`` set, text prompts are encoded by that Hugging Face tokenizer file:
    a text lookup matches the blocks stored for its token ids."""
    import tokenizers
    from fastapi.testclient import TestClient

    from prefixcache.blocks.hashing import BlockHasher
    from prefixcache.fleet.index.memory import MemoryFleetIndex
    from prefixcache.fleet.service.assembly import build_service
    from prefixcache.fleet.service.configuration.config_file import parse_config

    words = [f"w{i}" for i in range(40)]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = parse_config(
        {
            "tokenizer": "tokenizer.json",
            "replicas": [{"name": "a", "model": MODEL, "block_size": BLOCK}],
        },
        "fleet.yaml",
        tmp_path,
    )
    index = MemoryFleetIndex()
    text = " ".join(words[:10])  # ids 1..10: two full blocks of 4
    index.store("a", BlockHasher(BLOCK).hash_prompt(list(range(1, 11)), Namespace(MODEL)))
    with TestClient(build_service(config, index=index, ingest=None)) as client:
        body = client.post("/v1/lookup", json={"model": MODEL, "text": text}).json()
    assert body["prompt_tokens"] == 10
    assert body["replicas"][0]["cached_tokens"] == 8


def test_proxy_without_a_chat_template_says_chat_routing_is_approximate(tmp_path: Path) -> None:
    port = free_port()
    config = {
        "proxy": {"enabled": True},
        "health": {"probe_interval_s": None},
        "replicas": [{"name": "a", "model": MODEL, "url": f"http://127.0.0.1:{free_port()}"}],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["prefixcache", "serve", "--config", str(path), "--port", str(port)]
    with running(args, port, tmp_path / "serve.log"):
        pass
    log = (tmp_path / "serve.log").read_text()
    assert "no chat_template in the config" in log and "Traceback" not in log
