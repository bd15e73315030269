"""prefixcache against vLLM's and SGLang's own code, run from their published wheels
(tests/engine_wheels.py): vLLM's request block hasher gives the engine hashes the service
computes (``engine_hash``: seeds, cache salts, LoRA adapters); vLLM's own block pool caches and
evicts a salted request's blocks, and its events, like SGLang's, go out through the engine's
own ZMQ publisher to the service's subscriber, whose index then holds the blocks under the
digests prefixcache computes for the same tokens and namespace."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest

from tests.engine_wheels import SGLANG, VLLM, engine_modules, missing

pytest.importorskip("zmq", reason="the fleet needs the service extra")
pytest.importorskip("cbor2", reason="vLLM's sha256_cbor needs cbor2 (in the dev extra)")

from prefixcache import Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.fleet.events.engine_keys import EngineHasher, EngineHashSpec
from prefixcache.fleet.events.replica_stream import ReplicaEndpoint
from prefixcache.fleet.events.subscriber import KVEventSubscriber
from prefixcache.fleet.index.memory import MemoryFleetIndex

P = 16
NS = Namespace(model="m")


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    parts = urlsplit(path)
    return parts.scheme, parts.hostname or "", str(parts.port or "")


VLLM_GIVEN = {
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.envs": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": True},  # vLLM's default
    "vllm.utils.network_utils": {
        "get_ip": lambda: "127.0.0.1",
        "get_tcp_uri": lambda ip, port: f"tcp://{ip}:{port}",
        "is_valid_ipv6_address": lambda address: False,
        "split_zmq_path": _split_zmq_path,
    },
    "vllm.config.utils": {"config": __import__("dataclasses").dataclass},
}
VLLM_MODULES = [
    "vllm.utils.hashing",
    "vllm.v1.core.kv_cache_utils",
    "vllm.config.kv_events",
    "vllm.distributed.kv_events",
    "vllm.v1.core.block_pool",
]
VLLM_PLACEHOLDERS = [  # named by these modules for what these tests do not run
    "vllm.v1.core.kv_cache_metrics",
    "vllm.multimodal.utils",
    "vllm.utils.math_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.request",
    "vllm.v1.utils",
]


@pytest.fixture
def vllm(tmp_path):
    reason = missing(VLLM)
    if reason:
        pytest.skip(reason)
    with engine_modules(VLLM, VLLM_MODULES, VLLM_GIVEN, VLLM_PLACEHOLDERS, tmp_path) as mods:
        yield SimpleNamespace(
            hashing=mods["vllm.utils.hashing"],
            utils=mods["vllm.v1.core.kv_cache_utils"],
            events=mods["vllm.distributed.kv_events"],
            pool=mods["vllm.v1.core.block_pool"],
        )


def _vllm_hashes(vllm, tokens, *, seed, salt=None, lora=None, monkeypatch) -> list[bytes]:
    """vLLM's block hashes of a request, by its own request block hasher."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    vllm.utils.init_none_hash(vllm.hashing.sha256_cbor)
    hasher = vllm.utils.get_request_block_hasher(P, vllm.hashing.sha256_cbor)
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=list(tokens),
        mm_features=None,
        lora_request=None
        if lora is None
        else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]),
        cache_salt=salt,
        prompt_embeds=None,
    )
    return [bytes(h) for h in hasher(request)]


@pytest.mark.parametrize(
    "seed, salt, lora",
    [
        (None, None, None),
        ("42", None, None),
        (None, "tenant-a", None),
        ("7", "t", ("sql", "/a/sql")),
    ],
)
def test_vllm_request_hashes_equal_the_services_engine_hashes(vllm, monkeypatch, seed, salt, lora):
    tokens = np.random.default_rng(1).integers(0, 50_000, 5 * P + 3).tolist()
    theirs = _vllm_hashes(vllm, tokens, seed=seed, salt=salt, lora=lora, monkeypatch=monkeypatch)
    spec = EngineHashSpec(seed=seed, lora_paths={lora[0]: lora[1]} if lora else {})
    ours = EngineHasher(spec, P).digests(tokens, salt=salt, adapter=lora[0] if lora else None)
    assert len(theirs) == 5 and ours == theirs
    other = EngineHasher(EngineHashSpec(seed="not-" + str(seed)), P).digests(tokens, salt=salt)
    assert other[0] != theirs[0]  # a wrong seed is told apart at the first block


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_vllm_publisher_feeds_the_services_index(vllm, tmp_path, monkeypatch):
    """vLLM's ZmqEventPublisher (its PUB and replay sockets, its msgpack frames) sends what its
    block pool would: the subscriber indexes exactly the digests of the tokens."""
    tokens = np.random.default_rng(2).integers(0, 50_000, 4 * P).tolist()
    hashes = _vllm_hashes(vllm, tokens, seed=None, monkeypatch=monkeypatch)
    external = [vllm.utils.maybe_convert_block_hash(h) for h in hashes]
    assert all(isinstance(h, int) for h in external)
    ev = vllm.events
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ev.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep)
    index = MemoryFleetIndex()
    endpoint = ReplicaEndpoint("vllm-0", pub_ep, replay_ep, NS, P)
    subscriber = KVEventSubscriber(index, [endpoint])
    subscriber.start()
    try:
        time.sleep(0.5)  # the SUB socket joins before the first batch (a late one replays)

        def stored(first, k):
            parent = external[first - 1] if first else None
            return ev.BlockStored(
                block_hashes=external[first : first + k],
                parent_block_hash=parent,
                token_ids=tokens[first * P : (first + k) * P],
                block_size=P,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )

        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[stored(0, 2)]))
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[stored(2, 2)]))
        digests = BlockHasher(P).hash_prompt(tokens, NS)

        def held() -> int:
            return {m.replica: m.blocks for m in index.match(digests)}.get("vllm-0", 0)

        assert _wait_for(lambda: held() == 4), f"held {held()} of 4 blocks"
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[
            ev.BlockRemoved(block_hashes=external[3:], medium="GPU")
        ]))  # fmt: skip
        assert _wait_for(lambda: held() == 3)
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[ev.AllBlocksCleared()]))
        assert _wait_for(lambda: held() == 0)
    finally:
        subscriber.stop()
        publisher.shutdown()


def test_vllm_block_pool_events_index_as_prefixcache_digests(vllm, tmp_path, monkeypatch):
    """vLLM's own BlockPool caches a salted request's full blocks and evicts them under
    pressure; its events, through vLLM's publisher, put the blocks in the index under the
    salted namespace's digests and take them out again."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm.utils.init_none_hash(vllm.hashing.sha256_cbor)
    tokens = np.random.default_rng(4).integers(0, 50_000, 3 * P + 5).tolist()
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=list(tokens),
        mm_features=None,
        lora_request=None,
        cache_salt="tenant-a",
        prompt_embeds=None,
        session_id=None,
    )
    hasher = vllm.utils.get_request_block_hasher(P, vllm.hashing.sha256_cbor)
    request.block_hashes = hasher(request)
    pool = vllm.pool.BlockPool(5, True, P, enable_kv_cache_events=True)  # 4 usable + null
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3, P, 0)
    stored = pool.take_events()
    assert [type(e).__name__ for e in stored] == ["BlockStored"]
    ev = vllm.events
    pub_ep = f"ipc://{tmp_path}/pub"
    publisher = ev.ZmqEventPublisher(0, endpoint=pub_ep)
    index = MemoryFleetIndex()
    subscriber = KVEventSubscriber(index, [ReplicaEndpoint("vllm-0", pub_ep, None, NS, P)])
    subscriber.start()
    try:
        time.sleep(0.5)
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=stored))
        salted = Namespace(model="m", salt="tenant-a")
        digests = BlockHasher(P).hash_prompt(tokens, salted)

        def held() -> int:
            return {m.replica: m.blocks for m in index.match(digests)}.get("vllm-0", 0)

        assert _wait_for(lambda: held() == 3), f"held {held()} of 3"
        plain = BlockHasher(P).hash_prompt(tokens, NS)  # the unsalted prompt matches nothing
        assert "vllm-0" not in {m.replica for m in index.match(plain) if m.blocks}
        pool.free_blocks(reversed(blocks))  # the request ends: its blocks stay cached
        pool.get_new_blocks(4)  # pressure: vLLM evicts all three
        removed = pool.take_events()
        assert removed and all(type(e).__name__ == "BlockRemoved" for e in removed)
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=removed))
        assert _wait_for(lambda: held() == 0)
    finally:
        subscriber.stop()
        publisher.shutdown()


SGLANG_GIVEN = {
    "sglang.srt.runtime_context": {"get_parallel": lambda: SimpleNamespace()},
    "sglang.srt.utils.network": {},
}


@pytest.fixture
def sglang(tmp_path):
    reason = missing(SGLANG)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("pydantic", reason="SGLang's event module needs pydantic")
    modules = ["sglang.srt.disaggregation.kv_events"]
    with engine_modules(SGLANG, modules, SGLANG_GIVEN, [], tmp_path) as mods:
        yield mods["sglang.srt.disaggregation.kv_events"]


def test_sglang_publisher_feeds_the_services_index(sglang, tmp_path):
    """SGLang's ZmqEventPublisher and event structs, with the engine hashes its radix cache
    gives a page (sha256 chained over the page's token ids), are indexed as prefixcache's."""
    tokens = np.random.default_rng(3).integers(0, 50_000, 3 * P).tolist()
    engine = EngineHasher(EngineHashSpec(engine="sglang", algo="sha256"), P)
    external = engine.block_hashes(tokens)
    pub_ep = f"ipc://{tmp_path}/pub"
    publisher = sglang.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=None)
    index = MemoryFleetIndex()
    subscriber = KVEventSubscriber(index, [ReplicaEndpoint("sglang-0", pub_ep, None, NS, P)])
    subscriber.start()
    try:
        time.sleep(0.5)
        event = sglang.BlockStored(
            block_hashes=external,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=P,
            lora_id=None,
            medium="GPU",
        )
        publisher.publish(sglang.KVEventBatch(ts=time.time(), events=[event]))
        digests = BlockHasher(P).hash_prompt(tokens, NS)
        assert _wait_for(
            lambda: {m.replica: m.blocks for m in index.match(digests)}.get("sglang-0") == 3
        )
    finally:
        subscriber.stop()
        publisher.shutdown()


def test_engine_wheels_are_only_read(tmp_path):
    """The loader leaves nothing of an engine imported behind it."""
    import sys

    reason = missing(VLLM)
    if reason:
        pytest.skip(reason)
    with engine_modules(VLLM, VLLM_MODULES, VLLM_GIVEN, VLLM_PLACEHOLDERS, Path(tmp_path)):
        assert "vllm.distributed.kv_events" in sys.modules
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
