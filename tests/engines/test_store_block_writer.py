"""The vLLM store connector's write-through (``BlockWriter``) against a real LMDB store that
another process holds: the step hands blocks over and goes on, whatever the store does; up to
``queue_blocks`` wait for it, in steps of any size, past that they are dropped and counted; once
the store is free again every block that waited is written, checked, and reported stored.

The writer imports nothing of vLLM, so it runs in the project's own environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixcache.blocks.namespace import Namespace
from prefixcache.engines.store_tally import StoreTally
from prefixcache.engines.vllm.connector_tally import LOGGER
from prefixcache.engines.vllm.connector_writer import BlockWriter
from prefixcache.store.backend import StoreGate
from prefixcache.store.block_record import BlockLayout, check_record, namespace_fingerprint
from prefixcache.store.lmdb import LMDBBlockStore

LAYOUT = BlockLayout(32, 2, "float32", 4, (32, 2, 64))  # the tiny model's: 64 KiB a block
FP = namespace_fingerprint(Namespace("tiny-llama"))

# holds the store's write lock (an open write transaction) until its stdin closes
HOLDER = textwrap.dedent(
    """
    import sys, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=16, subdir=True, lock=True)
    txn = env.begin(write=True)
    print("held", flush=True)
    sys.stdin.read()
    txn.abort()
    """
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LMDBBlockStore]:
    opened = LMDBBlockStore(tmp_path / "kv", capacity_bytes=64 << 20)
    yield opened
    opened.close()


class Held:
    """Another process holding the store's write lock."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait() == 0


def blocks(n: int, start: int = 0) -> list[tuple[int, bytes, bytes, bytes | None, int]]:
    """``n`` blocks of one chain, vLLM block ids from 1."""
    digests = [os.urandom(16) for _ in range(n)]
    return [
        (1 + start + i, d, FP, digests[i - 1] if i else None, start + i)
        for i, d in enumerate(digests)
    ]


def fill(block_ids: list[int], rows: np.ndarray) -> None:
    """Block ``b``'s payload is the byte ``b % 251`` throughout."""
    for row, block_id in zip(rows, block_ids, strict=True):
        row[:] = block_id % 251


def writer_on(store: LMDBBlockStore, tally: StoreTally, queue_blocks: int) -> BlockWriter:
    import logging

    gate = StoreGate(2.0, "worker", logging.getLogger(LOGGER))
    return BlockWriter(store, LAYOUT, tally, gate, queue_blocks)


def test_small_steps_wait_up_to_the_bound_while_the_store_is_held(store, tmp_path):
    tally = StoreTally()
    writer = writer_on(store, tally, queue_blocks=128)
    held = Held(tmp_path / "kv")
    try:
        steps = [blocks(3, 3 * i) for i in range(40)]  # 120 blocks, three a step
        for step in steps:
            writer.take(step, fill)  # returns while the store is held: no step waits on it
        assert tally.totals().get("dropped_blocks", 0) == 0
        assert tally.totals()["queued_blocks"] == 120
    finally:
        held.release()
    writer.flush()
    assert tally.totals()["written_blocks"] == 120
    outcome = writer.take_outcome()
    assert outcome.settled == 120 and len(outcome.stored) == 120
    record = bytearray(LAYOUT.record_bytes)
    for step in steps:
        for block_id, digest, fp, _, _ in step:
            n = store.get_into(digest, memoryview(record))
            assert n == LAYOUT.record_bytes
            assert check_record(memoryview(record), digest, fp, LAYOUT) is None
            assert record[LAYOUT.header_bytes] == block_id % 251
    writer.close()


def test_past_the_bound_blocks_are_dropped_and_counted(store, tmp_path):
    tally = StoreTally()
    writer = writer_on(store, tally, queue_blocks=128)
    held = Held(tmp_path / "kv")
    try:
        writer.take(blocks(100), fill)
        writer.take(blocks(100, 100), fill)
        totals = tally.totals()
        assert totals["queued_blocks"] == 128 and totals["dropped_blocks"] == 72
    finally:
        held.release()
    writer.flush()
    assert tally.totals()["written_blocks"] == 128
    assert writer.take_outcome().settled == 200  # written, or dropped: none left pending
    writer.take(blocks(128, 200), fill)  # the buffers are free again
    writer.flush()
    assert tally.totals()["written_blocks"] == 256
    assert tally.totals()["dropped_blocks"] == 72
    writer.close()


def test_the_buffers_are_bounded_in_bytes_too(store, tmp_path):
    import logging

    tally = StoreTally()
    gate = StoreGate(2.0, "worker", logging.getLogger(LOGGER))
    bound = 100 * LAYOUT.record_bytes  # fewer than queue_blocks of these records
    writer = BlockWriter(store, LAYOUT, tally, gate, queue_blocks=1024, queue_bytes=bound)
    held = Held(tmp_path / "kv")
    try:
        for start in range(0, 150, 5):
            writer.take(blocks(5, start), fill)
        totals = tally.totals()
        assert totals["queued_blocks"] == 100 and totals["dropped_blocks"] == 50
    finally:
        held.release()
    writer.flush()
    assert tally.totals()["written_blocks"] == 100
    writer.close()


def test_the_connector_settings_take_the_byte_bound():
    from prefixcache.engines.vllm.connector_settings import parse_settings
    from prefixcache.errors import ConfigError

    given = {"store": "lmdb:///dev/shm/kv"}
    assert parse_settings(given).queue_bytes == 1 << 30
    assert parse_settings({**given, "queue_bytes": "256MiB"}).queue_bytes == 256 << 20
    assert parse_settings({**given, "queue_bytes": 1 << 20}).queue_bytes == 1 << 20
    with pytest.raises(ConfigError, match="queue_bytes"):
        parse_settings({**given, "queue_bytes": "lots"})
    with pytest.raises(ConfigError, match="queue_bytes"):
        parse_settings({**given, "queue_bytes": 0})
