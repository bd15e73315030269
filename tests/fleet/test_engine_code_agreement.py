"""prefixcache against vLLM's and SGLang's own code, run from their published wheels
(tests/engine_wheels.py): vLLM's request block hasher and SGLang's page hashing (its native
extension, built from the wheel's source) give the engine hashes the service computes
(``engine_hash``: seeds, cache salts, LoRA adapters); vLLM's own block pool and SGLang's radix
cache event recorder store and evict a salted request's blocks, and their events go out through
each engine's own ZMQ publisher to the service's subscriber, whose index then holds the blocks
under the digests prefixcache computes for the same tokens and namespace."""

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
    spec = EngineHashSpec(
        algo="sha256_cbor", seed=seed, lora_paths={lora[0]: lora[1]} if lora else {}
    )
    ours = EngineHasher(spec, P).digests(tokens, salt=salt, adapter=lora[0] if lora else None)
    assert len(theirs) == 5 and ours == theirs
    other_seed = EngineHashSpec(algo="sha256_cbor", seed="not-" + str(seed))
    other = EngineHasher(other_seed, P).digests(tokens, salt=salt)
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


def _compile_extension(root: Path):
    """SGLang's loader of its C++ extensions, as torch builds them (with ninja)."""

    def load(name, sources, extra_cflags, extra_ldflags, with_cuda):
        from torch.utils import cpp_extension

        build = root / "build"
        build.mkdir(exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=extra_cflags,
            extra_ldflags=extra_ldflags,
            build_directory=str(build),
        )

    return load


SGLANG_MODULES = [
    "sglang.srt.disaggregation.kv_events",
    "sglang.srt.mem_cache.cpp_utils.native_hash",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.events",
]
SGLANG_PLACEHOLDERS = [  # GPU kernels, settings and eviction policies the recorder never runs
    "sglang.kernels.ops.kvcache.mla_buffer",
    "sglang.srt.environ",
    "sglang.srt.mem_cache.evict_policy",
]


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    reason = missing(SGLANG)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("pydantic", reason="SGLang's event module needs pydantic")
    root = tmp_path_factory.mktemp("sglang")
    given = {
        "sglang.srt.runtime_context": {"get_parallel": lambda: SimpleNamespace()},
        "sglang.srt.utils.network": {},
        "sglang.srt.utils.cpp_extension_loader": {
            "load_extension_with_recovery": _compile_extension(root)
        },
    }
    source = ("sglang/srt/mem_cache/cpp_utils/hash_binding.cpp",)
    with engine_modules(SGLANG, SGLANG_MODULES, given, SGLANG_PLACEHOLDERS, root, source) as mods:
        native = mods["sglang.srt.mem_cache.cpp_utils.native_hash"]
        try:  # built here, once: g++, ninja and OpenSSL's headers (libssl-dev)
            native.get_native_hash([1] * P, None, P)
        except RuntimeError as exc:
            pytest.skip(f"SGLang's native hash extension could not be built: {exc.__cause__}")
        yield SimpleNamespace(
            events=mods["sglang.srt.disaggregation.kv_events"],
            recorder=mods["sglang.srt.mem_cache.events"],
        )


class _RadixKey:
    """What SGLang's radix cache keys a node by: its tokens and namespace."""

    def __init__(self, token_ids, cache_salt=None):
        self.token_ids, self.extra_key, self.cache_salt = token_ids, None, cache_salt
        self.is_bigram = False

    def __len__(self):
        return len(self.token_ids)


class _RadixNode:
    def __init__(self, key, parent):
        self.key, self.parent = key, parent
        self.hash_value = [] if parent is None else None
        self.event_hash_value = None


def _sglang_events(sglang, tokens, salt=None):
    """The events SGLang's radix cache records for a node of ``tokens`` under the root."""
    root = _RadixNode(_RadixKey([]), None)
    node = _RadixNode(_RadixKey(list(tokens), salt), root)
    recorder = sglang.recorder.KVCacheEventRecorder(enabled=True, page_size=P)
    recorder.record_store(node)
    stored = recorder.take()
    recorder.record_remove(node)
    return stored, recorder.take()


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sglang_page_hashes_equal_the_services_engine_hashes(sglang, salt):
    """SGLang's own page hashing (its native extension, built from the wheel's source) and
    event recorder give the hashes the service computes for ``engine_hash: sglang``."""
    tokens = np.random.default_rng(5).integers(0, 50_000, 4 * P).tolist()
    stored, removed = _sglang_events(sglang, tokens, salt)
    theirs = [h for event in stored for h in event.block_hashes]
    ours = EngineHasher(EngineHashSpec(engine="sglang", algo="sha256"), P).block_hashes(
        tokens, salt=salt
    )
    assert len(theirs) == 4 and ours == theirs
    assert [h for event in removed for h in event.block_hashes] == theirs


def test_sglang_publisher_feeds_the_services_index(sglang, tmp_path):
    """What SGLang's radix cache records for a salted prompt, through SGLang's own publisher,
    is indexed under prefixcache's digests in the salted namespace, and removed again."""
    tokens = np.random.default_rng(3).integers(0, 50_000, 3 * P).tolist()
    stored, removed = _sglang_events(sglang, tokens, "tenant-a")
    ev = sglang.events
    pub_ep = f"ipc://{tmp_path}/pub"
    publisher = ev.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=None)
    index = MemoryFleetIndex()
    subscriber = KVEventSubscriber(index, [ReplicaEndpoint("sglang-0", pub_ep, None, NS, P)])
    subscriber.start()
    try:
        time.sleep(0.5)
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=stored))
        digests = BlockHasher(P).hash_prompt(tokens, Namespace(model="m", salt="tenant-a"))

        def held() -> int:
            return {m.replica: m.blocks for m in index.match(digests)}.get("sglang-0", 0)

        assert _wait_for(lambda: held() == 3), f"held {held()} of 3"
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=removed))
        assert _wait_for(lambda: held() == 0)
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
