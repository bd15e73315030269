"""The store connector inside vLLM's own scheduler (0.32 CPU build), without a model run: what
it offers, loads and writes, what it refuses, what it announces and counts.

Runs in vLLM's virtualenv (``test_connector_in_vllm.py`` one folder up starts it there); skipped
anywhere vLLM does not import.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

pytest.importorskip("vllm", reason="runs in vLLM's virtualenv: test_connector_in_vllm.py")

import torch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm_parts import Engine, make_config, make_request

from prefixcache.blocks.namespace import Namespace
from prefixcache.engines.store_access import acquire_store, release_store
from prefixcache.engines.vllm.connector_keys import PromptKeyMaker
from prefixcache.errors import ConfigError
from prefixcache.store.block_record import namespace_fingerprint

BS = 32


def prompt(n: int, seed: int = 1) -> list[int]:
    return [3 + (i * 7 + seed * 131) % 3000 for i in range(n)]


@pytest.fixture
def store_url(tmp_path):
    return f"lmdb://{tmp_path / 'kv'}?capacity=64MiB"


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(url: str, **kw) -> Engine:
        num_blocks = kw.pop("num_blocks", 256)
        engine = Engine(make_config(url, **kw), num_blocks=num_blocks)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@contextmanager
def opened(url: str):
    """The process's client of the store (the connector's, when it has one open)."""
    store = acquire_store(url)
    try:
        yield store
    finally:
        release_store(url)


def digests(tokens: list[int], salt: str | None = None, adapter: str | None = None) -> list[bytes]:
    return (
        PromptKeyMaker(BS, "xxh3_128")
        .keys(Namespace("tiny-llama", adapter, None, salt), tokens)
        .digests
    )


def test_a_second_engine_loads_what_the_first_computed_byte_for_byte(store_url, engines):
    tokens = prompt(300)  # 9 full blocks of 32 and 12 tokens
    a = engines(store_url, max_batched=64)  # chunked prefill: the prompt over 5 steps
    ra = a.add(make_request(tokens))
    a.run()
    totals = a.worker.tally.totals()
    assert totals["queued_blocks"] == 9 and totals["written_blocks"] == 9  # each block once
    assert a.connector.tally.totals()["queries"] == 1  # one query for the request
    with opened(store_url) as store:
        assert store.exists(digests(tokens)) == [True] * 9

    b = engines(store_url)
    rb = b.add(make_request(tokens))
    b.step()
    assert b.loaded_tokens[rb.request_id] == 288  # every full block; the last token computed
    for j in range(9):
        assert torch.equal(b.block_kv(rb, j), b.expected_kv(rb, j))
    b.run()
    assert b.forward_tokens == 300 - 288 + 1  # the prompt's tail, then one decode step
    assert b.worker.tally.totals().get("queued_blocks", 0) == 0  # loaded blocks not rewritten
    assert b.worker.tally.totals()["loaded_blocks"] == 9
    assert b.load_errors == set()
    del ra


def test_a_local_hit_is_continued_from_the_store(store_url, engines):
    tokens = prompt(400)
    a = engines(store_url)
    a.add(make_request(tokens))
    a.run()

    b = engines(store_url)
    first = b.add(make_request(tokens[:130]))  # 4 full blocks in vLLM's own cache
    b.run()
    assert b.loaded_tokens[first.request_id] == 128
    second = b.add(make_request(tokens))
    b.step()
    assert b.loaded_tokens[second.request_id] == 384  # 4 local + 8 from the store
    assert b.worker.tally.totals()["loaded_blocks"] == 4 + 8
    for j in range(12):
        assert torch.equal(b.block_kv(second, j), b.expected_kv(second, j))


def test_cache_salt_and_adapter_are_namespaces(store_url, engines):
    tokens = prompt(200)
    a = engines(store_url)
    a.add(make_request(tokens, cache_salt="tenant:acme"))
    a.run()
    b = engines(store_url)
    plain = b.add(make_request(tokens))
    other = b.add(make_request(tokens, cache_salt="tenant:other"))
    lora = b.add(make_request(tokens, cache_salt="tenant:acme", lora="sql"))
    b.step()
    assert b.loaded_tokens[plain.request_id] == 0
    assert b.loaded_tokens[other.request_id] == 0
    assert b.loaded_tokens[lora.request_id] == 0
    b.run()
    c = engines(store_url)
    same = c.add(make_request(tokens, cache_salt="tenant:acme"))
    c.step()
    assert c.loaded_tokens[same.request_id] == 192


def test_other_weights_under_the_same_name_never_load(store_url, engines):
    tokens = prompt(200)
    a = engines(store_url, weights="revision-a")
    a.add(make_request(tokens))
    a.run()
    b = engines(store_url, weights="revision-b")
    other = b.add(make_request(tokens))
    b.step()
    assert b.loaded_tokens[other.request_id] == 0
    c = engines(store_url, weights="revision-a")
    same = c.add(make_request(tokens))
    c.step()
    assert c.loaded_tokens[same.request_id] == 192


def test_the_store_blocks_are_announced_with_vllms_hashes(tmp_path, engines):
    url = f"lmdb://{tmp_path / 'kv'}?capacity=1MiB"  # 16 records of 64 KiB and a bit
    tokens = prompt(200)
    a = engines(url)
    request = a.add(make_request(tokens))
    a.run()
    stored = a.published.take("BlockStored")
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == [maybe_convert_block_hash(h) for h in request.block_hashes[:6]]
    assert {e.medium for e in stored} == {"STORE"}
    assert not a.connector.has_pending_push_work()
    more = a.add(make_request(prompt(900, seed=2)))  # 28 blocks: the store evicts
    a.run()
    removed = a.published.take("BlockRemoved")
    gone = [h for e in removed for h in e.block_hashes]
    evicted = a.worker.tally.totals()["evicted_blocks"]
    assert evicted > 0 and {e.medium for e in removed} == {"STORE"}
    assert set(gone) <= {
        maybe_convert_block_hash(h) for h in request.block_hashes + more.block_hashes
    }
    assert len(gone) + a.connector.tally.totals().get("unannounced_removals", 0) == evicted


def test_pending_writes_keep_vllm_stepping_until_settled(store_url, engines):
    a = engines(store_url)
    a.add(make_request(prompt(100), max_tokens=1))
    out = a.scheduler.schedule()
    assert len(out.kv_connector_metadata.saves[0].blocks) == 3
    assert a.connector.has_pending_push_work()  # planned, not yet reported settled


def test_a_corrupt_record_is_refused_removed_recomputed_and_announced(store_url, engines):
    tokens = prompt(300)
    a = engines(store_url)
    ra = a.add(make_request(tokens))
    a.run()
    a.published.take("BlockStored")
    keys = digests(tokens)
    with opened(store_url) as store:
        record = bytearray(1 << 20)
        n = store.get_into(keys[4], memoryview(record))
        assert n is not None
        record[n - 5] ^= 0xFF  # one byte of the last layer's V
        store.remove(keys[4])
        store.put_many([(keys[4], bytes(record[:n]))])

    b = engines(store_url)
    rb = b.add(make_request(tokens))
    b.run()
    totals = b.worker.tally.totals()
    assert totals["refused_checksum"] == 1
    assert totals["loaded_blocks"] == 4  # the blocks before it; nothing after it unchecked
    assert totals["load_failed_blocks"] == 5
    assert len(b.load_errors) == 5
    assert totals["queued_blocks"] == 5  # the refused block and the unchecked ones after it,
    # written again (replacing what the store holds) once computed
    for j in range(9):  # vLLM computed the refused block and the ones after it
        assert torch.equal(b.block_kv(rb, j), b.expected_kv(rb, j))
    with opened(store_url) as store:
        assert store.exists([keys[4]]) == [True]  # written again by the engine that computed it
    removed = b.published.take("BlockRemoved")
    assert [h for e in removed for h in e.block_hashes] == [
        maybe_convert_block_hash(rb.block_hashes[4])
    ]
    del ra


def test_a_record_gone_between_query_and_load_is_computed(store_url, engines):
    tokens = prompt(300)
    a = engines(store_url)
    a.add(make_request(tokens))
    a.run()
    b = engines(store_url)
    rb = b.add(make_request(tokens))
    offered = b.connector.get_num_new_matched_tokens(rb, 0)
    assert offered == (288, False)
    with opened(store_url) as store:
        store.remove(digests(tokens)[0])
    b.run()
    assert b.worker.tally.totals()["refused_missing"] == 1
    assert b.worker.tally.totals().get("loaded_blocks", 0) == 0
    for j in range(9):
        assert torch.equal(b.block_kv(rb, j), b.expected_kv(rb, j))


def test_another_layout_under_the_same_model_name_is_refused(store_url, engines, monkeypatch):
    tokens = prompt(200)
    a = engines(store_url)
    a.add(make_request(tokens))
    a.run()
    import vllm_parts

    monkeypatch.setattr(vllm_parts, "HEADS", 4)  # another model, served as tiny-llama
    b = engines(store_url)
    rb = b.add(make_request(tokens))
    b.run()
    assert b.worker.tally.totals()["refused_layout"] == 1
    assert b.worker.tally.totals().get("loaded_blocks", 0) == 0
    assert b.load_errors  # reported, computed
    del rb


def test_a_store_that_fails_is_left_alone_and_requests_are_computed(store_url, engines):
    tokens = prompt(300)
    a = engines(store_url)
    a.add(make_request(tokens))
    a.run()
    b = engines(store_url, retry_after=3600)
    b.connector._scheduler.store._env.close()  # the store's client fails every call now
    first = b.add(make_request(tokens))
    b.run()
    second = b.add(make_request(prompt(300, seed=5)))
    b.run()
    sched = b.connector.tally.totals()
    assert sched["queries"] == 2 and sched["query_errors"] == 2
    assert b.loaded_tokens[first.request_id] == 0 and b.loaded_tokens[second.request_id] == 0
    work = b.worker.tally.totals()
    assert work.get("written_blocks", 0) == 0
    assert work.get("write_errors", 0) + work.get("dropped_blocks", 0) == 18
    assert not b.connector.has_pending_push_work()


def test_settings_are_checked_before_vllm_starts(store_url, tmp_path):
    from vllm_parts import Engine as E

    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        E(make_config(store_url, policy="fail"))
    with pytest.raises(ConfigError, match="unknown setting"):
        E(make_config(store_url, capacity="1GiB"))
    with pytest.raises(ConfigError, match="unknown store"):
        E(make_config("redis://127.0.0.1:6379"))
    with pytest.raises(ConfigError, match="hash_algo"):
        E(make_config(store_url, hash_algo="md5"))


def test_a_cache_layout_it_cannot_read_is_refused_at_registration(store_url, engines):
    a = engines(store_url)
    wrong = {"layer0": torch.zeros(16, 2, 2, 32, 64)}  # a GPU-style [2, blocks, ...] tensor
    with pytest.raises(ConfigError, match="CPU attention layout"):
        a.worker.register_kv_caches(wrong)


def test_record_fingerprints_follow_the_namespace():
    assert namespace_fingerprint(Namespace("tiny-llama")) != namespace_fingerprint(
        Namespace("tiny-llama", salt="x")
    )
