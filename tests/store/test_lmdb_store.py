"""The one-host store: bounded with its own eviction, shared by processes, and a writer killed
mid-transaction leaves nothing behind."""

import multiprocessing as mp
import os

import pytest

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache.errors import ConfigError
from prefixcache.store.lmdb import LMDBBlockStore

MIB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_put_exists_get_remove(tmp_path):
    store = LMDBBlockStore(tmp_path / "kv", capacity_bytes=4 * MIB)
    assert store.put_many([(key(1), b"a" * 100), (key(2), b"b" * 50)]) == 2
    assert store.put_many([(key(1), b"z" * 100)]) == 0  # held: equal digest, equal K/V
    assert store.exists([key(1), key(3), key(2)]) == [True, False, True]
    out = memoryview(bytearray(200))
    assert store.get_into(key(1), out) == 100 and bytes(out[:100]) == b"a" * 100
    assert store.get_into(key(3), out) is None
    assert store.get_into(key(1), memoryview(bytearray(10))) == 100  # too long: not copied
    store.remove(key(1))
    assert store.exists([key(1)]) == [False] and store.used_bytes() == 50
    store.close()


def test_the_bound_evicts_the_oldest_first(tmp_path):
    store = LMDBBlockStore(tmp_path / "kv", capacity_bytes=2 * MIB)
    value = bytes(256 << 10)
    for i in range(20):
        store.put_many([(key(i), value)])
    assert store.used_bytes() <= 2 * MIB
    assert store.evicted() == 20 - len(store) > 0
    held = store.exists([key(i) for i in range(20)])
    assert held == sorted(held)  # the oldest went: a prefix of False, then True
    assert held[-1]
    store.close()


def test_a_bad_capacity_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        LMDBBlockStore(tmp_path / "kv", capacity_bytes=10)


def _writer(path: str, commit: bool) -> None:
    import lmdb

    env = lmdb.open(path, max_dbs=3, map_size=64 * MIB)
    records = env.open_db(b"records")
    txn = env.begin(write=True)
    txn.put(key(7), bytes(8) + b"half a block", db=records)
    if commit:
        txn.commit()
    os._exit(0)  # killed: no commit, no close


def _reader(path: str, queue) -> None:
    store = LMDBBlockStore(path, capacity_bytes=4 * MIB)
    queue.put(store.exists([key(1), key(7)]))


def test_processes_share_it_and_a_killed_writer_leaves_nothing(tmp_path):
    path = str(tmp_path / "kv")
    store = LMDBBlockStore(path, capacity_bytes=4 * MIB)
    store.put_many([(key(1), b"x" * 64)])
    ctx = mp.get_context("spawn")
    w = ctx.Process(target=_writer, args=(path, False))
    w.start()
    w.join(60)
    assert w.exitcode == 0
    queue = ctx.Queue()
    r = ctx.Process(target=_reader, args=(path, queue))
    r.start()
    assert queue.get(timeout=60) == [True, False]  # another process sees ours, not the torn one
    r.join(60)
    assert store.exists([key(7)]) == [False]
    store.close()
