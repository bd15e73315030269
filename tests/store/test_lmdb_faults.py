"""The one-host store under what processes sharing it do to it: a process killed inside a read,
a capacity larger than the filesystem's free space, processes that open it with different
capacities. Every one keeps the store serving, or is refused at open with a clear error."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache.errors import ConfigError
from prefixcache.store import lmdb as lmdb_store
from prefixcache.store.lmdb import LMDBBlockStore

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---- a process killed inside a read ----------------------------------------------------------
def _read_and_hang(path: str, ready) -> None:
    """A runtime in the middle of a read: the read transaction is open when it is killed."""
    store = LMDBBlockStore(path, capacity_bytes=2 * MIB)
    with store._env.begin(db=store._records, buffers=True) as txn:  # get_into's read, held
        assert txn.get(key(0)) is not None
        ready.set()
        threading.Event().wait()  # until killed


def test_a_process_killed_inside_a_read_does_not_fill_the_map(tmp_path):
    path = str(tmp_path / "kv")
    store = LMDBBlockStore(path, capacity_bytes=2 * MIB)
    value = bytes(256 << 10)
    store.put_many([(key(0), value)])
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    reader = ctx.Process(target=_read_and_hang, args=(path, ready))
    reader.start()
    try:
        assert _started(ready, reader), "the reader did not start its read"
        os.kill(reader.pid, signal.SIGKILL)  # killed inside the read: its slot stays behind
        reader.join(60)
        assert reader.exitcode == -signal.SIGKILL
        # many times the map: every page freed after the dead read must be reused
        for i in range(1, 1200):  # 300 MiB: past any map this store had
            store.put_many([(key(i), value)])
        assert store.used_bytes() <= 2 * MIB and store.exists([key(i)]) == [True]
    finally:
        if reader.is_alive():
            reader.kill()
        reader.join(10)
        store.close()


def _open_and_count(path: str, results) -> None:
    store = LMDBBlockStore(path, capacity_bytes=2 * MIB)
    results.put(store.stale_readers_cleared)
    store.close()


def test_a_dead_reader_is_cleared_when_the_store_is_opened(tmp_path):
    """While another process keeps the store open (so LMDB keeps its reader table), the next
    process to open it clears the slot of the one killed inside a read."""
    path = str(tmp_path / "kv")
    first = LMDBBlockStore(path, capacity_bytes=2 * MIB)
    first.put_many([(key(0), b"x" * 100)])
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_read_and_hang, args=(path, ready))
    reader.start()
    try:
        assert _started(ready, reader), "the reader did not start its read"
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(60)
        opener = ctx.Process(target=_open_and_count, args=(path, results))
        opener.start()
        assert results.get(timeout=120) == 1
        opener.join(60)
    finally:
        if reader.is_alive():
            reader.kill()
        reader.join(10)
        first.close()


# ---- a capacity larger than the filesystem ----------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 48 MiB tmpfs (Docker's default /dev/shm is 64 MiB); mounting needs root."""
    where = tmp_path / "shm"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


FILL = """
import sys
from prefixcache.store.lmdb import LMDBBlockStore
from prefixcache.errors import ConfigError
capacity = None if sys.argv[2] == "default" else int(sys.argv[2])
try:
    store = LMDBBlockStore(sys.argv[1], capacity_bytes=capacity)
except ConfigError as exc:
    print("refused:", exc)
    raise SystemExit(3)
value = bytes(256 << 10)
for i in range(800):  # 200 MiB through it
    store.put_many([(i.to_bytes(16, "big"), value)])
print("capacity", store.capacity_bytes, "used", store.used_bytes(), "map", store.map_bytes)
"""


def _fill(path: Path, capacity: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FILL), str(path / "kv"), capacity],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_a_capacity_past_the_tmpfs_is_refused_at_open(small_tmpfs):
    done = _fill(small_tmpfs, str(1 << 30))  # the old default, on a 48 MiB tmpfs
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])
    message = done.stdout
    assert "capacity_bytes" in message and "MiB free" in message and "48" in message, message


def test_the_default_capacity_fits_the_tmpfs_and_fills_without_a_crash(small_tmpfs):
    done = _fill(small_tmpfs, "default")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    fields = done.stdout.split()
    capacity, used, map_bytes = int(fields[1]), int(fields[3]), int(fields[5])
    assert 0 < used <= capacity and map_bytes <= 48 * MIB
    assert "bounded" in done.stderr  # said so


def test_the_free_space_check_without_a_tmpfs(tmp_path, monkeypatch):
    """The same decision through the free-space reading, where no tmpfs can be mounted."""
    monkeypatch.setattr(lmdb_store, "free_bytes", lambda path: 48 * MIB)
    with pytest.raises(ConfigError, match=r"48\.0 MiB free"):
        LMDBBlockStore(tmp_path / "kv", capacity_bytes=1 << 30)
    store = LMDBBlockStore(tmp_path / "kv2")
    try:
        assert store.map_bytes <= 24 * MIB  # half the free room by default
    finally:
        store.close()


# ---- processes opening one store with different capacities -----------------------------------
def _big_writer(path: str, done) -> None:
    store = LMDBBlockStore(path, capacity_bytes=256 * MIB)
    value = bytes(1 << 20)
    for i in range(1000, 1000 + 150):  # far past the small opener's map
        store.put_many([(key(i), value)])
    store.close()
    done.set()


def test_a_smaller_opener_adopts_the_larger_map(tmp_path):
    path = str(tmp_path / "kv")
    small = LMDBBlockStore(path, capacity_bytes=2 * MIB)
    small.put_many([(key(1), b"a" * 100)])
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    writer = ctx.Process(target=_big_writer, args=(path, done))
    writer.start()
    writer.join(300)
    assert writer.exitcode == 0 and done.is_set()
    try:
        held = small.exists([key(1000), key(1149)])  # the larger process's records
        assert held == [True, True]
        out = memoryview(bytearray(2 * MIB))
        assert small.get_into(key(1149), out) == MIB
        assert small.put_many([(key(2), b"b" * 100)]) == 1
        assert small.capacity_bytes == 256 * MIB  # the store's bound is the larger one
    finally:
        small.close()


def _big_store(path: str, ready, go, results) -> None:
    """A process with the larger capacity, writing past where a smaller map would end."""
    store = LMDBBlockStore(path, capacity_bytes=256 * MIB)
    ready.set()
    go.wait(120)
    value = bytes(1 << 20)
    for i in range(150):
        store.put_many([(key(100 + i), value)])
    results.put(store.exists([key(249), key(5)]))
    store.close()


def _started(event, proc, timeout: float = 120) -> bool:
    """Wait for ``event`` while ``proc`` lives (a child that failed does not hold the test)."""
    for _ in range(int(timeout / 0.2)):
        if event.wait(0.2):
            return True
        if not proc.is_alive():
            return event.is_set()
    return False


def test_a_smaller_opener_never_shrinks_the_map_under_a_larger_one(tmp_path):
    """LMDB sizes the file to each opener's map: a smaller opener used to cut it under the
    larger process, whose next write past the cut died of SIGBUS."""
    path = str(tmp_path / "kv")
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    big = ctx.Process(target=_big_store, args=(path, ready, go, results))
    big.start()
    try:
        assert _started(ready, big), "the larger process did not open the store"
        small = LMDBBlockStore(path, capacity_bytes=2 * MIB)
        small.put_many([(key(5), b"c" * 100)])
        capacity = small.capacity_bytes
        small.close()
        go.set()
        big.join(300)
        assert big.exitcode == 0, f"the larger process died: exit {big.exitcode}"
        assert results.get(timeout=10) == [True, True]
        assert capacity == 256 * MIB  # the smaller opener took the store's bound
    finally:
        go.set()
        big.join(10)
