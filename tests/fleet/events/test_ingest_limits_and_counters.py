"""The ingest's own knobs and counters: the kept-block counters on /metrics, the YAML's
``limits.redis_read_timeout_s`` and ``limits.ingest_workers``, a replica's ``engine_hash``
reaching its subscriber from ``prefixcache serve``, and SGLang's EAGLE token pairs."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from vllm_structs import BlockStored, KVEventBatch

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import ConfigError, WireFormatError
from prefixcache.fleet.events.engine_keys import EngineHasher, EngineHashSpec
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.events.wire import decode_batch, unpair_tokens
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.configuration.config_file import Limits, parse_config
from tests.fleet_support import served_configs

P = 4
NS = Namespace("llama")


def _metric(text: str, name: str, replica: str) -> float:
    found = re.search(rf'^{name}\{{replica="{replica}"\}} (\S+)$', text, re.M)
    assert found, name
    return float(found.group(1))


def test_metrics_export_the_unplaced_placed_late_and_late_counters() -> None:
    from fastapi.testclient import TestClient

    from prefixcache.fleet.service.assembly import build_service

    entry = {"name": "a", "model": "llama", "block_size": P, "engine_hash": "vllm-sha256_cbor"}
    config = parse_config({"replicas": [entry]})
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(index, [ReplicaEndpoint("a", namespace=NS, block_size=P)])
    tokens = list(range(10, 10 + 4 * P))
    hashes = EngineHasher(EngineHashSpec("vllm", "sha256_cbor"), P).block_hashes(tokens)
    # blocks 2..3 under a parent this router never saw: kept, then placed by a lookup
    stored = BlockStored(hashes[2:4], hashes[1], tokens[2 * P :], P, None, "GPU", None)
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, [stored], 0))
    with TestClient(build_service(config, index=index, ingest=sub)) as client:
        sub.ingest("a", 0, payload)
        sub.ingest("a", 0, payload)  # the same batch again: late, skipped
        before = client.get("/metrics").text
        assert _metric(before, "prefixcache_ingest_blocks_unplaced_total", "a") == 2
        assert _metric(before, "prefixcache_ingest_blocks_placed_late_total", "a") == 0
        assert _metric(before, "prefixcache_ingest_late_batches_total", "a") == 1
        body = client.post("/v1/lookup", json={"model": "llama", "tokens": tokens}).json()
        assert body["replicas"][0]["cached_tokens"] == 4 * P
        after = client.get("/metrics").text
    assert _metric(after, "prefixcache_ingest_blocks_placed_late_total", "a") == 4
    assert _metric(after, "prefixcache_ingest_events_total", "a") == 1


def test_redis_read_timeout_and_ingest_workers_are_read_from_limits() -> None:
    def limits(**kw: Any) -> Limits:
        return parse_config({"replicas": [{"name": "a", "model": "m"}], "limits": kw}).limits

    assert (limits().redis_read_timeout_s, limits().ingest_workers) == (0.5, 4)
    got = limits(redis_read_timeout_s=2, ingest_workers=1)
    assert (got.redis_read_timeout_s, got.ingest_workers) == (2, 1)
    for bad in ({"redis_read_timeout_s": 0}, {"redis_read_timeout_s": "1"}):
        with pytest.raises(ConfigError, match=r"limits\.redis_read_timeout_s"):
            limits(**bad)
    for bad in ({"ingest_workers": 0}, {"ingest_workers": 1.5}, {"ingest_workers": True}):
        with pytest.raises(ConfigError, match=r"limits\.ingest_workers"):
            limits(**bad)


def test_serve_passes_engine_hash_workers_and_read_timeout_on(
    tmp_path, redis_server, monkeypatch
) -> None:

    from prefixcache.cli import main
    from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

    served = served_configs(monkeypatch)
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"index: {redis_server.url}\n"
        "limits: {redis_read_timeout_s: 1.5, ingest_workers: 2}\n"
        "replicas:\n"
        "  - {name: a, model: m, events: 'tcp://127.0.0.1:1', engine_hash: vllm-sha256_cbor}\n"
        "  - {name: b, model: m, events: 'tcp://127.0.0.1:2'}\n"
    )
    assert main(["serve", "--config", str(path)]) == 0
    (app,) = (config.app for config in served)
    service = app.state.service
    index = service.router.index
    try:
        assert isinstance(index, RedisFleetIndex) and index.sync.read_timeout == 1.5
        sub = service.ingest
        assert isinstance(sub, KVEventSubscriber) and sub.ingest_workers == 2
        eps = {name: rep.ep for name, rep in sub._replicas.items()}
        assert eps["a"].engine_hash == EngineHashSpec("vllm", "sha256_cbor")
        assert eps["b"].engine_hash is None
    finally:
        index.close()


# ---- SGLang with EAGLE: token ids as bigram pairs ---------------------------------------------


def _sglang_batch(token_ids: list[Any], hashes: list[int]) -> bytes:
    """A batch as SGLang 0.5.23 sends it: map events without lora_name, medium set."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": token_ids,
        "block_size": P,
        "lora_id": None,
        "medium": "GPU",
    }
    return msgspec.msgpack.encode([1.0, [event], 0])


def test_sglang_eagle_bigram_pairs_are_read_as_their_positions_tokens() -> None:
    raw = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # the key's raw tokens: 8 bigrams, one more token
    pairs = [(raw[j], raw[j + 1]) for j in range(8)]  # as SGLang's recorder builds them
    assert decode_batch(_sglang_batch(pairs, [11, 12])).events[0].token_ids == raw[:8]
    assert unpair_tokens(raw) is raw  # plain ids as sent
    for bad in ([(1, 2), (3, 4)], [(1, 2), 2], [1, (1, 2)]):
        with pytest.raises(WireFormatError):
            unpair_tokens(bad)  # type: ignore[arg-type]

    index = MemoryFleetIndex()
    sub = KVEventSubscriber(index, [ReplicaEndpoint("s", namespace=NS, block_size=P)])
    assert sub.ingest("s", 0, _sglang_batch([list(p) for p in pairs], [-3, 4])) == 1
    broken = [list(p) for p in pairs]
    broken[3] = [99, 99]  # pairs that do not chain: malformed, nothing stored
    assert sub.ingest("s", 1, _sglang_batch(broken, [21, 22])) == 0
    counts = sub.counters()["s"]
    assert (counts.malformed, counts.blocks_stored) == (1, 2)
    digests = BlockHasher(P).hash_prompt(raw[:8], NS)
    assert [m.blocks for m in index.match(digests)] == [2]
