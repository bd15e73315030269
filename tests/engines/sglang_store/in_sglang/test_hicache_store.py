"""prefixcache's HiCache storage backend inside SGLang 0.5.23's own code: SGLang's factory builds
it from the ``dynamic`` config, SGLang's host memory pool holds the pages, SGLang's cache
controller moves them (its zero-copy and older calls), SGLang's page hashing names them.

Runs with SGLang's wheel in vLLM's virtualenv (``test_hicache_in_sglang.py`` one folder up).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

from prefixcache.engines.sglang.hicache_store import PrefixcacheHiCacheStorage
from prefixcache.engines.store_access import acquire_store, release_store
from prefixcache.errors import ConfigError

LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 2, 2, 64, 32, 512
PAGES = 4


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool on the CPU, over device K/V buffers of ``TOKENS`` tokens."""
    k = tuple(torch.zeros(TOKENS + PAGE, HEADS, HEAD_DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS + PAGE, HEADS, HEAD_DIM) for _ in range(LAYERS))

    def pointers(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )


@pytest.fixture
def store_url():
    with tempfile.TemporaryDirectory(prefix="hicache-") as folder:
        yield f"lmdb://{folder}/kv?capacity=64MiB"


def backend(url: str, pool, *, model: str = "tiny", tp: tuple[int, int] = (0, 1), **more):
    """The backend as SGLang builds it: its factory, ``dynamic``, our module path."""
    extra = {
        "backend_name": "prefixcache",
        "module_path": "prefixcache.engines.sglang.hicache_store",
        "class_name": "PrefixcacheHiCacheStorage",
        "interface_v1": 1,
        "store": url,
        **more,
    }
    config = HiCacheStorageConfig(
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model,
        extra_config=extra,
    )
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)  # as SGLang's cache controller does next
    return made


def page_keys(tokens: list[int], salt: str | None = None) -> list[str]:
    """SGLang's keys of the pages of ``tokens``: its chained page hashes."""
    keys, prior = [], storage_namespace_seed(None, salt)
    for i in range(len(tokens) // PAGE):
        prior = get_hash_str(tokens[i * PAGE : (i + 1) * PAGE], prior)
        keys.append(prior)
    return keys


def controller(made, pool):
    """What SGLang's cache controller's storage calls read of it."""
    return SimpleNamespace(
        storage_backend=made, storage_host_pool=pool, mem_pool_host=pool, page_size=PAGE
    )


def pages_of(pool, first_token: int) -> torch.Tensor:
    """The ``PAGES`` pages from ``first_token`` on, in one order whatever the layout."""
    return torch.stack(
        [pool.get_data_page(first_token + i * PAGE, flat=False).clone() for i in range(PAGES)]
    )


@contextmanager
def opened(url: str):
    store = acquire_store(url)
    try:
        yield store
    finally:
        release_store(url)


TOKENS_A = [3 + (i * 37) % 30000 for i in range(PAGES * PAGE)]
OPERATION = SimpleNamespace(request_id="r", is_terminated=lambda: False)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_pages_round_trip_through_sglangs_zero_copy_calls(store_url, layout):
    pool = host_pool(layout)
    made = backend(store_url, pool)
    assert isinstance(made, PrefixcacheHiCacheStorage)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    written = pages_of(pool, 0)
    keys = page_keys(TOKENS_A)
    ctl = controller(made, pool)
    assert HiCacheController._page_set_zero_copy(ctl, keys, torch.arange(PAGES * PAGE))
    assert made.batch_exists(keys) == PAGES
    pool.kv_buffer.zero_()
    into = torch.arange(PAGES * PAGE, 2 * PAGES * PAGE)
    assert HiCacheController._page_get_zero_copy(ctl, OPERATION, keys, into) == PAGES
    assert torch.equal(pages_of(pool, PAGES * PAGE), written)
    assert made.counters()["loaded_pages"] == PAGES
    made.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_round_trip_through_sglangs_older_calls(store_url, layout):
    pool = host_pool(layout)
    made = backend(store_url, pool, interface_v1=0)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    written = pages_of(pool, 0)
    keys = page_keys(TOKENS_A)
    ctl = controller(made, pool)
    assert HiCacheController._generic_page_set(ctl, keys, torch.arange(PAGES * PAGE))
    pool.kv_buffer.zero_()
    into = torch.arange(PAGES * PAGE, 2 * PAGES * PAGE)
    assert HiCacheController._generic_page_get(ctl, OPERATION, keys, into) == PAGES
    assert torch.equal(pages_of(pool, PAGES * PAGE), written)
    made.close()


def test_pages_written_in_batches_with_the_pages_before_them(store_url):
    pool = host_pool("page_first")
    made = backend(store_url, pool)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    keys = page_keys(TOKENS_A)
    half = PAGES // 2
    first = HiCacheStorageExtraInfo(prefix_keys=[])
    second = HiCacheStorageExtraInfo(prefix_keys=keys[:half])
    assert all(made.batch_set_v1(keys[:half], torch.arange(half * PAGE), first))
    rest = torch.arange(half * PAGE, PAGES * PAGE)
    assert all(made.batch_set_v1(keys[half:], rest, second))
    assert made.batch_exists(keys, second) == PAGES
    made.close()


def test_a_page_written_in_one_layout_reads_into_another(store_url):
    first, second = host_pool("page_first"), host_pool("page_head")
    writer, reader = backend(store_url, first), backend(store_url, second)
    first.kv_buffer.copy_(torch.randn_like(first.kv_buffer))
    keys = page_keys(TOKENS_A)
    assert all(writer.batch_set_v1(keys, torch.arange(PAGES * PAGE)))
    assert reader.batch_get_v1(keys, torch.arange(PAGES * PAGE)) == [True] * PAGES
    for i in range(PAGES):
        a = first.get_data_page(i * PAGE, flat=False)  # [2, P, L, H, D]
        b = second.get_data_page(i * PAGE, flat=False)[:, 0]  # [2, H, P, L, D]
        assert torch.equal(a, b.permute(0, 2, 3, 1, 4))
    writer.close()
    reader.close()


def test_a_corrupt_record_is_refused_removed_and_computed(store_url):
    pool = host_pool("page_first")
    made = backend(store_url, pool)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    keys = page_keys(TOKENS_A)
    made.batch_set_v1(keys, torch.arange(PAGES * PAGE))
    with opened(store_url) as store:
        digest = made.store_key(keys[2])
        record = bytearray(1 << 20)
        n = store.get_into(digest, memoryview(record))
        assert n is not None
        record[n - 7] ^= 0x40
        store.remove(digest)
        store.put_many([(digest, bytes(record[:n]))])
    pool.kv_buffer.zero_()
    ctl = controller(made, pool)
    into = torch.arange(PAGES * PAGE, 2 * PAGES * PAGE)
    assert HiCacheController._page_get_zero_copy(ctl, OPERATION, keys, into) == 2
    assert made.counters()["refused_checksum"] == 1
    assert made.batch_exists(keys) == 2  # removed: the next writer replaces it
    assert not pool.kv_buffer[:, (PAGES + 2) * PAGE :].any()  # nothing of it reached the pool
    made.close()


def test_models_weights_ranks_and_salts_never_share_a_page(store_url):
    pool = host_pool("page_first")
    made = backend(store_url, pool)
    keys = page_keys(TOKENS_A)
    made.batch_set_v1(keys, torch.arange(PAGES * PAGE))
    assert backend(store_url, pool, model="other").batch_exists(keys) == 0
    assert backend(store_url, pool, tp=(1, 2)).batch_exists(keys) == 0
    assert backend(store_url, pool, weights="revision-b").batch_exists(keys) == 0
    assert made.batch_exists(page_keys(TOKENS_A, salt="tenant:acme")) == 0
    assert made.batch_exists(keys) == PAGES


def test_a_store_that_fails_finds_nothing_and_writes_nothing(store_url):
    pool = host_pool("page_first")
    made = backend(store_url, pool, retry_after=3600)
    keys = page_keys(TOKENS_A)
    made.store._env.close()  # the store's client fails every call now
    assert made.batch_exists(keys) == 0
    assert made.batch_set_v1(keys, torch.arange(PAGES * PAGE)) == [False] * PAGES
    assert made.batch_get_v1(keys, torch.arange(PAGES * PAGE)) == [False] * PAGES
    counts = made.counters()
    assert counts["query_errors"] == 1 and counts["dropped_pages"] == PAGES  # left alone
    assert counts["refused_error"] == 1


def test_settings_are_checked(store_url):
    pool = host_pool("page_first")
    with pytest.raises(ConfigError, match="needs 'store'"):
        backend("", pool)
    with pytest.raises(ConfigError, match="unknown setting"):
        backend(store_url, pool, capacity="1GiB")
    mla = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny",
        extra_config={"store": store_url},
    )
    with pytest.raises(ConfigError, match="MLA"):
        PrefixcacheHiCacheStorage(mla, {})
