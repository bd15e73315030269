"""The tiny runtime sharing K/V through a store, as a user would run it: a second process
loads what the first computed, and every fault (the store down, a block gone between the
query and the load, corrupt or foreign bytes, a full store, slow writes, a store restarted
empty) keeps it serving the same tokens and logits, with counters that say what happened."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.store.backend import KVBlockStore, StoreUnavailableError
from prefixcache.store.block_record import BlockLayout, encode_header
from prefixcache.store.lmdb import LMDBBlockStore

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_runtime.py"
MIB = 1 << 20


@pytest.fixture(scope="module")
def runtime() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_runtime_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _same(out: dict, runtime: ModuleType) -> None:
    assert out["identical"] and out["max_logit_diff"] <= runtime.LOGIT_TOL


def test_a_second_process_loads_what_the_first_computed(tmp_path):
    """Two runtime processes, one after the other, on one store directory."""
    store = str(tmp_path / "kv")

    def run() -> dict:
        cmd = [sys.executable, str(SCRIPT), "--store", store, "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["loaded_blocks"] == 0 and first["written_blocks"] > 0
    assert second["loaded_blocks"] > 0
    alone = second["system_tokens_computed_alone"]
    assert alone > 0 and second["system_tokens_computed"] <= 0.1 * alone  # >= 90% fewer
    assert second["identical"] and second["max_logit_diff"] <= 1e-4


class Faulty(KVBlockStore):
    """A store around the LMDB one that fails as told."""

    def __init__(self, inner: LMDBBlockStore, *, down=False, vanish=0, writes_wait=None):
        self.inner, self.down, self.vanish, self.writes_wait = inner, down, vanish, writes_wait

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailableError("connection refused")

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        return self.inner.exists(keys)

    def get_into(self, key, out):
        self._check()
        if self.vanish:  # evicted by someone else since the query
            self.vanish -= 1
            self.inner.remove(key)
        return self.inner.get_into(key, out)

    def put_many(self, items, *, places=None, replace=()):
        self._check()
        if self.writes_wait is not None:
            self.writes_wait.wait(60)
        return self.inner.put_many(items, places=places, replace=replace)

    def touch(self, keys):
        self._check()
        self.inner.touch(keys)

    def remove(self, key):
        self._check()
        self.inner.remove(key)

    def evicted(self):
        return self.inner.evicted()

    def close(self):
        self.inner.close()


def _filled(runtime: ModuleType, path: Path, capacity: int = 64 * MIB) -> None:
    """A store holding what one run computed."""
    store = LMDBBlockStore(path, capacity)
    out = runtime.compare_store(store)
    store.close()
    assert out["written_blocks"] > 0


def test_the_store_down_recomputes_everything(runtime, tmp_path):
    _filled(runtime, tmp_path / "kv")
    store = Faulty(LMDBBlockStore(tmp_path / "kv", 64 * MIB), down=True)
    out = runtime.compare_store(store)
    store.close()
    _same(out, runtime)
    assert out["loaded_blocks"] == 0 and out["query_errors"] > 0 and out["write_errors"] > 0
    assert out["system_tokens_computed"] == out["system_tokens_computed_alone"]


def test_a_block_gone_between_query_and_load_is_recomputed(runtime, tmp_path):
    _filled(runtime, tmp_path / "kv")
    store = Faulty(LMDBBlockStore(tmp_path / "kv", 64 * MIB), vanish=1)
    out = runtime.compare_store(store)
    store.close()
    _same(out, runtime)
    assert out["refused"] == {"missing": 1} and out["requeued"] >= 1
    assert out["loaded_blocks"] > 0  # the rest still came from the store


@pytest.mark.parametrize("damage", ["payload", "layout", "namespace"])
def test_corrupt_or_foreign_records_are_refused_and_removed(runtime, tmp_path, damage):
    path = tmp_path / "kv"
    _filled(runtime, path)
    store = LMDBBlockStore(path, 64 * MIB)
    victims = store.keys()[:2]
    for key in victims:
        buf = bytearray(1 << 20)
        n = store.get_into(key, memoryview(buf))
        record = bytes(buf[:n])
        if damage == "payload":
            record = record[:-5] + bytes([record[-5] ^ 0x40]) + record[-4:]
        else:
            layout = BlockLayout(16, 2, "float32", 4, (16, 2, 64))
            other = layout._replace(shape=(16, 4, 32)) if damage == "layout" else layout
            ns = bytes(16) if damage == "namespace" else record[24:40]
            head = encode_header(key, ns, other, record[68 - 16 : 68])
            record = head + record[len(head) :]
        store.remove(key)
        store.put_many([(key, record)])
    out = runtime.compare_store(store)
    _same(out, runtime)
    reason = {"payload": "checksum", "layout": "layout", "namespace": "namespace"}[damage]
    assert set(out["refused"]) == {reason} and out["requeued"] >= 1
    assert all(store.exists(victims))  # refused, removed, and written again by the recompute
    store.close()


def test_a_full_store_evicts_and_still_serves(runtime, tmp_path):
    store = LMDBBlockStore(tmp_path / "kv", 1 * MIB)  # 32 of the run's 32 KiB records
    store.put_many([(i.to_bytes(16, "big"), bytes(32 << 10)) for i in range(30)])  # others'
    out = runtime.compare_store(store)
    _same(out, runtime)
    assert store.evicted() > 0 and store.used_bytes() <= 1 * MIB
    out = runtime.compare_store(store)  # what the first run wrote is what was kept
    _same(out, runtime)
    assert out["loaded_blocks"] > 0
    store.close()


def test_slow_writes_drop_blocks_and_never_hold_a_step(runtime, tmp_path):
    gate = threading.Event()
    store = Faulty(LMDBBlockStore(tmp_path / "kv", 64 * MIB), writes_wait=gate)
    mgr_kv = runtime.new_cache(runtime.ModelConfig(), num_blocks=64, stepped=True)
    connector = runtime.KVStoreConnector(store, mgr_kv[1], queue_blocks=2)
    mgr = runtime.CacheManager(64, 16, stepped=True, store=connector)
    model = runtime.TinyDecoder(runtime.ModelConfig())
    prompts = runtime.rotating_prompt_batch(8, 2, 64, model.cfg.vocab)
    ns = runtime.Namespace(model="tiny-random")
    runtime.run_requests(model, mgr, mgr_kv[1], ns, prompts, max_new_tokens=2, store=connector)
    counters = connector.counters()
    assert counters.dropped_blocks > 0  # the writer was stuck: the queue filled, steps went on
    gate.set()
    connector.close()
    assert connector.counters().written_blocks <= 3


def test_a_store_restarted_empty_is_filled_again(runtime, tmp_path):
    path = tmp_path / "kv"
    _filled(runtime, path)
    store = LMDBBlockStore(path, 64 * MIB)
    store.clear()  # restarted empty
    out = runtime.compare_store(store)
    store.close()
    _same(out, runtime)
    assert out["loaded_blocks"] == 0 and out["written_blocks"] > 0


@pytest.mark.parametrize("damage", ["payload", "layout"])
def test_the_write_that_recomputes_a_refused_record_replaces_it(runtime, tmp_path, damage):
    """Two bad records in a row of one chain (corrupt, or of another layout): the load stops at
    the first, so the second is never read; the recompute writes both, and both are replaced,
    so the next process loads them."""
    path = tmp_path / "kv"
    _filled(runtime, path)
    store = LMDBBlockStore(path, 64 * MIB)
    cfg = runtime.ModelConfig()
    prompt = runtime.rotating_prompt_batch(8, 2, 64, cfg.vocab)["req-0"]
    chain = BlockHasher(16).hash_prompt(prompt, runtime.Namespace(model="tiny-random"))
    victims = chain[:2]  # the first two blocks of the first system prompt
    good = {}
    for key in victims:
        buf = bytearray(1 << 20)
        n = store.get_into(key, memoryview(buf))
        good[key] = record = bytes(buf[:n])
        if damage == "payload":
            record = record[:-5] + bytes([record[-5] ^ 0x40]) + record[-4:]
        else:  # as a runtime of another layout writes the same digest
            other = BlockLayout(16, 2, "float32", 4, (16, 4, 32))
            head = encode_header(key, record[24:40], other, record[68 - 16 : 68])
            record = head + record[len(head) :]
        store.remove(key)
        store.put_many([(key, record)])
    first = runtime.compare_store(store)
    _same(first, runtime)
    for key in victims:  # both written again as this runtime computed them
        buf = bytearray(1 << 20)
        n = store.get_into(key, memoryview(buf))
        assert bytes(buf[:n]) == good[key]
    second = runtime.compare_store(store)
    _same(second, runtime)
    assert second["refused"] == {} and second["requeued"] == 0
    store.close()
