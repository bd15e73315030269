"""Two real vLLM servers (the CPU build) share prefixes through one LMDB store with prefixcache's
connector, and keep serving the same tokens when the store fails them.

Each prompt is first served by server ``a`` on a cold cache: its answer is the uncached answer.
Server ``b`` then gets the same prompt, which only ``a`` has seen: it loads the blocks ``a``
wrote (``cached_tokens``) and must answer the same greedy tokens. The faults are made from this
process on the store itself: a corrupt record, the store emptied, a store too small for what is
written. The servers' own counters (``/metrics``) say what happened.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from store_support import (
    checkout_import_path,
    complete,
    prompt,
    store_counters,
    store_server,
    wait_for_counter,
)

from prefixcache.blocks.namespace import Namespace
from prefixcache.engines.vllm.connector_keys import PromptKeyMaker
from prefixcache.engines.vllm.launcher import VLLMFleet
from prefixcache.store.lmdb import LMDBBlockStore

BLOCK = 32
PROMPT = 2000  # 62 full blocks: 1,984 tokens a second server can load
CAPACITY = 8 << 20  # about 120 records of the tiny model (64 KiB each): two prompts' worth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmdb-pair")
    path = Path("/dev/shm") / f"prefixcache-test-{uuid.uuid4().hex[:12]}"
    url = f"lmdb://{path}?capacity={CAPACITY}"
    import_path = checkout_import_path(tmp / "path")
    specs = [store_server(n, i, url, import_path) for i, n in enumerate(("a", "b"))]
    try:
        with VLLMFleet(specs, log_dir=tmp / "logs") as fleet:
            yield fleet["a"].url, fleet["b"].url, path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def digests(tokens: list[int]) -> list[bytes]:
    return PromptKeyMaker(BLOCK, "xxh3_128").keys(Namespace("tiny-llama"), tokens).digests


def served_on_a(a: str, tokens: list[int]):
    """``a`` answers ``tokens`` cold, and its writes reach the store."""
    before = store_counters(a).get("written_blocks", 0.0)
    cold = complete(a, tokens)
    assert cold.cached_tokens == 0
    wait_for_counter(a, "written_blocks", before + len(tokens) // BLOCK)
    return cold


def test_the_second_server_loads_the_first_servers_prefix(pair):
    a, b, _ = pair
    for seed in (1, 2):
        tokens = prompt(PROMPT, seed)
        cold = served_on_a(a, tokens)
        warm = complete(b, tokens)
        assert warm.cached_tokens >= 0.9 * PROMPT  # 1,984: every full block
        assert warm.text == cold.text
    counters = store_counters(b)
    assert counters["loaded_blocks"] >= 124 and counters.get("load_failed_blocks", 0) == 0


def test_a_corrupt_record_is_computed_and_counted(pair):
    a, b, path = pair
    tokens = prompt(PROMPT, 3)
    cold = served_on_a(a, tokens)
    key = digests(tokens)[10]
    store = LMDBBlockStore(path, capacity_bytes=CAPACITY)
    try:
        record = bytearray(1 << 20)
        n = store.get_into(key, memoryview(record))
        assert n is not None
        record[n - 100] ^= 0x01  # one bit of one V element of the last layer
        store.remove(key)
        store.put_many([(key, bytes(record[:n]))])
    finally:
        store.close()
    before = store_counters(b)
    warm = complete(b, tokens)
    assert warm.text == cold.text
    wait_for_counter(b, "refused_checksum", before.get("refused_checksum", 0) + 1)
    after = store_counters(b)
    assert after["loaded_blocks"] - before.get("loaded_blocks", 0) == 10  # the blocks before it
    again = complete(b, tokens)  # b's own cache now, recomputed from the refused block on
    assert again.text == cold.text


def test_a_store_emptied_under_the_servers_is_recomputed(pair):
    a, b, path = pair
    tokens = prompt(PROMPT, 4)
    cold = served_on_a(a, tokens)
    store = LMDBBlockStore(path, capacity_bytes=CAPACITY)
    try:
        store.clear()  # as a store restarted empty
    finally:
        store.close()
    before = store_counters(b)
    warm = complete(b, tokens)
    assert warm.cached_tokens == 0 and warm.text == cold.text
    wait_for_counter(b, "written_blocks", before.get("written_blocks", 0) + 62)  # b refills it
    assert store_counters(b)["found_blocks"] == before.get("found_blocks", 0)


def test_a_full_store_evicts_and_the_answers_stay_the_same(pair):
    a, b, _ = pair
    colds = {}
    for seed in (5, 6, 7):  # three prompts: 186 records, the store holds about 120
        tokens = prompt(PROMPT, seed)
        colds[seed] = served_on_a(a, tokens).text
    assert store_counters(a)["evicted_blocks"] > 0
    latest = complete(b, prompt(PROMPT, 7))  # the last one written is still whole
    assert latest.cached_tokens >= 0.9 * PROMPT and latest.text == colds[7]
    for seed in (5, 6):  # their leading blocks went first: computed
        assert complete(b, prompt(PROMPT, seed)).text == colds[seed]
