"""The one-host store: LMDB on a memory-backed path, shared by every process that opens it.

LMDB (a B-tree in one memory-mapped file) is made for many processes at once: readers never
block, writers take turns under its own lock, and a transaction is visible whole or not at all,
so a writer killed mid-put leaves nothing behind (and every record carries its checksum as
well). On a tmpfs path (``/dev/shm``) a get is a B-tree lookup and one copy out of the shared
page cache.

**Size.** The store holds at most ``capacity_bytes`` of records; past it, records go in use
order, tails before heads (lmdb_use_order.py), counted in ``evicted()``, which every process
sees. The map (the file) is sized above the bound (``map_bytes_for``) for the B-tree's pages
and the pages open reads still pin, and every page of it may be touched: on tmpfs a page
written past the filesystem's free space kills the process (SIGBUS), so a store whose map does
not fit the free space is refused at open (``StoreTooLargeError``, naming the free space). The
default capacity, 1 GiB, is bounded to half the free space instead (logged): Docker's /dev/shm
is 64 MiB.

**One store, many processes.** The store's capacity is the largest any opener asked for (kept
in the store): a process that asks for less adopts it and the larger map, at open or when
another process grows the store under it (LMDB's ``MDB_MAP_RESIZED``). Opens take turns under a
lock file, and no opener ever maps less than the file holds: LMDB sizes the file to each
opener's map, and a smaller map used to cut the file under a larger process's pages.

**A process killed inside a read** leaves its reader slot behind, pinning every page freed
after its snapshot; the slots of dead processes are cleared at open and whenever a write finds
the map full (LMDB's reader check), so the store keeps its pages.

A record is stored as it is given (one copy into the map). A new store's first fill is slower
than its steady state: every page it writes is a first touch of tmpfs memory; once at its
bound, it writes into pages its evictions freed.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from prefixcache.errors import ConfigError
from prefixcache.store.backend import (
    BlockPlace,
    KVBlockStore,
    StoreUnavailableError,
    import_client,
)
from prefixcache.store.lmdb_use_order import EPOCHS, UseOrder
from prefixcache.store.map_gate import MapGate

log = logging.getLogger("prefixcache.store")
T = TypeVar("T")
MIB = 1 << 20
DEFAULT_PATH = "/dev/shm/prefixcache-kv"
DEFAULT_CAPACITY = 1 << 30
FORMAT = b"2"  # the tables' layout; a store of another is emptied at open
_SEQ, _USED, _EVICTED, _CAPACITY = b"seq", b"used", b"evicted", b"capacity"
_EPOCH, _EPOCH_BYTES, _FORMAT = b"epoch", b"epoch_bytes", b"format"
_ALIGN = 1 << 16


class StoreTooLargeError(ConfigError):
    """The store's map does not fit in the free space of its filesystem."""


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def map_bytes_for(capacity_bytes: int) -> int:
    """The map a store of ``capacity_bytes`` needs: the records, half as much again for the
    B-tree's pages and pages pinned by reads, and 8 MiB."""
    size = capacity_bytes + capacity_bytes // 2 + 8 * MIB
    return -(-size // _ALIGN) * _ALIGN


def _capacity_within(map_room: int) -> int:
    """The largest capacity whose map fits in ``map_room`` bytes."""
    return max(0, (map_room - 8 * MIB - _ALIGN) * 2 // 3)


def _u64(value: bytes | memoryview | None) -> int:
    return int.from_bytes(bytes(value), "little") if value is not None else 0


def _b64(value: int) -> bytes:
    return max(0, value).to_bytes(8, "little")


class _Resized(Exception):
    """The store's capacity grew past this process's map: adopt it, then retry."""


class LMDBBlockStore(KVBlockStore):
    """Block records in an LMDB environment at ``path`` (a directory; created), holding at
    most ``capacity_bytes`` of records (default 1 GiB, bounded to half the free space)."""

    name = "lmdb"

    def __init__(
        self, path: str | os.PathLike[str] = DEFAULT_PATH, capacity_bytes: int | None = None
    ):
        lmdb = import_client(
            "lmdb", "the one-host K/V store needs lmdb: pip install 'prefixcache[store]'"
        )
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise ConfigError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
            if capacity_bytes < MIB:
                raise ConfigError(f"capacity_bytes must be at least 1 MiB, got {capacity_bytes}")
        self._lmdb = lmdb
        self.path = Path(path)
        self._gate = MapGate()
        self._evicted_keys: list[bytes] = []  # by this process's writes, not yet taken
        self.stale_readers_cleared = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with self._open_lock():
                self._open(capacity_bytes)
        except (OSError, lmdb.Error) as exc:
            raise ConfigError(f"cannot open the K/V store at {self.path}: {exc}") from None

    # ---- opening and sizing -------------------------------------------------------------------
    @contextmanager
    def _open_lock(self) -> Iterator[None]:
        """Opens and map changes take turns across processes."""
        with open(self.path / "open.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _file(self) -> tuple[int, int]:
        """The data file's size and the bytes of it already allocated (0, 0 before any)."""
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:
            return 0, 0
        return st.st_size, st.st_blocks * 512

    def _fits(self, map_bytes: int, capacity: int, asked: bool) -> None:
        """StoreTooLargeError unless a map of ``map_bytes`` fits in the free space."""
        _, allocated = self._file()
        free = free_bytes(self.path)
        if map_bytes - allocated <= free:
            return
        who = "capacity_bytes" if asked else "the store's capacity (set by another process)"
        raise StoreTooLargeError(
            f"{who} {capacity / MIB:.1f} MiB needs a {map_bytes / MIB:.1f} MiB map at "
            f"{self.path}, but its filesystem has {free / MIB:.1f} MiB free: pass "
            f"capacity_bytes <= {_capacity_within(free + allocated) / MIB:.1f} MiB or give the "
            "filesystem more room (docker run --shm-size)"
        )

    def _open(self, capacity: int | None) -> None:
        lmdb = self._lmdb
        asked = capacity is not None
        if capacity is None:
            _, allocated = self._file()
            room = (free_bytes(self.path) + allocated) // 2
            capacity = min(DEFAULT_CAPACITY, max(MIB, _capacity_within(room)))
            if capacity < DEFAULT_CAPACITY:
                log.warning(
                    "K/V store at %s: capacity bounded to %.1f MiB (half the free space of its "
                    "filesystem; pass capacity_bytes to choose)",
                    self.path,
                    capacity / MIB,
                )
        size, _ = self._file()
        map_bytes = max(map_bytes_for(capacity), size)  # never less than the file holds
        self._fits(map_bytes, capacity, asked)
        self._env = lmdb.open(
            str(self.path),
            map_size=map_bytes,
            max_dbs=8,
            writemap=True,
            sync=False,  # memory-backed: nothing to flush, and a crash loses only a cache
            metasync=False,
            readahead=False,
            max_readers=512,
        )
        self.stale_readers_cleared = int(self._env.reader_check())
        self._records = self._env.open_db(b"records")
        self._order = UseOrder(self._env.open_db(b"blocks"), self._env.open_db(b"evict_order"))
        self._meta = self._env.open_db(b"meta")
        self.map_bytes = map_bytes
        with self._env.begin(write=True) as txn:
            if txn.get(_FORMAT, db=self._meta) != FORMAT:
                self._reformat(txn)
            held = _u64(txn.get(_CAPACITY, db=self._meta))
            if capacity > held:
                txn.put(_CAPACITY, _b64(capacity), db=self._meta)
        self.capacity_bytes = max(capacity, held)
        if self.capacity_bytes > capacity:  # another process asked for more: adopt its map
            self._grow(self.capacity_bytes)

    def _reformat(self, txn: Any) -> None:
        """Empty a store written in another layout (it is a cache) and mark this one."""
        for name in (b"records", b"blocks", b"evict_order", b"order", b"seqs"):
            try:
                db = self._env.open_db(name, txn=txn, create=False)
            except self._lmdb.NotFoundError:
                continue
            txn.drop(db, delete=False)
        txn.put(_USED, _b64(0), db=self._meta)
        txn.put(_FORMAT, FORMAT, db=self._meta)

    def _grow(self, capacity: int) -> None:
        """Map as much as the store's capacity needs (and the file holds); with no transaction
        of this process open."""
        size, _ = self._file()
        map_bytes = max(map_bytes_for(capacity), size, self.map_bytes)
        if map_bytes > self.map_bytes:
            self._fits(map_bytes, capacity, asked=False)
        self._env.set_mapsize(map_bytes)
        self.map_bytes = map_bytes

    def _adopt(self) -> None:
        """Another process grew the store: take its capacity and map, with no transaction of
        this process open. Never a smaller map than the file holds (so never
        ``set_mapsize(0)``, which takes the last writer's, maybe smaller, map)."""
        with self._gate.exclusive(), self._open_lock():
            self._grow(self.capacity_bytes)  # the whole file: every page written so far
            with self._env.begin(db=self._meta) as txn:
                held = _u64(txn.get(_CAPACITY))
            if held > self.capacity_bytes:
                self.capacity_bytes = held
                self._grow(held)

    def _run(self, operation: Callable[[], T]) -> T:
        """``operation`` in the map as it is, adopting the store's map when another process
        grew it; an LMDB failure is StoreUnavailableError (a full map is left to the
        writer)."""
        lmdb = self._lmdb
        for _ in range(3):
            try:
                with self._gate:
                    return operation()
            except (lmdb.MapResizedError, _Resized):
                pass
            except lmdb.MapFullError:
                raise
            except lmdb.Error as exc:
                raise StoreUnavailableError(f"lmdb: {exc}") from exc
            try:
                self._adopt()
            except (lmdb.Error, ConfigError) as exc:
                raise StoreUnavailableError(f"lmdb: cannot map the grown store: {exc}") from exc
        raise StoreUnavailableError("lmdb: the store kept growing under this process")

    # ---- reads ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:  # the common case inline: a read costs the step what LMDB's costs
            with self._gate:
                return self._exists(keys)
        except self._lmdb.MapResizedError:
            return self._run(partial(self._exists, keys))
        except self._lmdb.Error as exc:
            raise StoreUnavailableError(f"lmdb: {exc}") from exc

    def _exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._env.begin(db=self._records, buffers=True) as txn:
            return [txn.get(k) is not None for k in keys]

    def get_into(self, key: bytes, out: memoryview) -> int | None:
        try:
            with self._gate:
                return self._get_into(key, out)
        except self._lmdb.MapResizedError:
            return self._run(partial(self._get_into, key, out))
        except self._lmdb.Error as exc:
            raise StoreUnavailableError(f"lmdb: {exc}") from exc

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        with self._env.begin(db=self._records, buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                return None
            n = len(value)
            if n <= len(out):
                out[:n] = value  # one copy out of the shared map
            return n

    def _meta_value(self, name: bytes) -> int:
        def read() -> int:
            with self._env.begin(db=self._meta) as txn:
                return _u64(txn.get(name))

        return self._run(read)

    def evicted(self) -> int:
        return self._meta_value(_EVICTED)

    def used_bytes(self) -> int:
        """Record bytes held now."""
        return self._meta_value(_USED)

    def keys(self) -> list[bytes]:
        """Every key held now, the next evicted first."""

        def read() -> list[bytes]:
            with self._env.begin() as txn:
                return self._order.keys(txn)

        return self._run(read)

    def __len__(self) -> int:
        def read() -> int:
            with self._env.begin(db=self._records) as txn:
                return int(txn.stat(self._records)["entries"])

        return self._run(read)

    # ---- writes -----------------------------------------------------------------------------
    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        *,
        places: Mapping[bytes, BlockPlace] | None = None,
        replace: Collection[bytes] = (),
    ) -> int:
        lmdb = self._lmdb
        for attempt in range(3):
            write = partial(self._write, items, places or {}, replace, attempt)
            try:
                return self._run(write)
            except lmdb.MapFullError:
                pass
            # the map is full though the records are under the bound: free the slots of
            # readers that died inside a read (their snapshots pin the pages freed since),
            # then evict more and try again
            with self._gate:
                self.stale_readers_cleared += int(self._env.reader_check())
        raise StoreUnavailableError("lmdb: the map is full even after evicting")

    def _write(
        self,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        places: Mapping[bytes, BlockPlace],
        replace: Collection[bytes],
        attempt: int,
    ) -> int:
        """One write transaction; each attempt after a full map keeps 1/8 of the capacity
        more free."""
        spare = attempt * (self.capacity_bytes // 8)
        with self._env.begin(write=True) as txn:
            stored, gone = self._put(txn, items, places, replace, spare)
        self._evicted_keys += gone  # committed
        return stored

    def _put(
        self,
        txn: Any,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        places: Mapping[bytes, BlockPlace],
        replace: Collection[bytes],
        spare: int,
    ) -> tuple[int, list[bytes]]:
        """Insert what is new (and replace what ``replace`` names), evicting in use order to
        stay ``spare`` bytes under the bound; returns how many were stored and the keys
        evicted."""
        meta = self._meta
        capacity = _u64(txn.get(_CAPACITY, db=meta))
        if capacity > self.capacity_bytes:
            raise _Resized  # another process grew the store: map it first
        seq = _u64(txn.get(_SEQ, db=meta))
        used = _u64(txn.get(_USED, db=meta))
        epoch = max(1, _u64(txn.get(_EPOCH, db=meta)))
        epoch_bytes = _u64(txn.get(_EPOCH_BYTES, db=meta))
        order, records = self._order, self._records
        evicted = stored = 0
        gone: list[bytes] = []
        for key, value in items:
            size = len(value)
            held = txn.get(key, db=records)
            if held is not None:
                if key not in replace:
                    order.refresh(txn, key, epoch)  # written again: in use
                    continue
                used -= len(held)
                txn.delete(key, db=records)
                order.remove(txn, key)
            if size > capacity:
                continue
            while used + size > capacity - spare:
                victim = order.first(txn)
                if victim is None:
                    break
                old = txn.pop(victim, db=records)
                order.remove(txn, victim)
                if old is not None:
                    used -= len(old)
                    evicted += 1
                    gone.append(victim)
            seq += 1
            place = places.get(key)
            parent, index = (place.parent, place.block_index) if place else (None, 0)
            txn.put(key, value, db=records)
            order.add(txn, key, parent, index, epoch, seq)
            used += size
            stored += 1
            epoch_bytes += size
            if epoch_bytes * EPOCHS >= capacity:
                epoch, epoch_bytes = epoch + 1, 0
        txn.put(_SEQ, _b64(seq), db=meta)
        txn.put(_USED, _b64(used), db=meta)
        txn.put(_EPOCH, _b64(epoch), db=meta)
        txn.put(_EPOCH_BYTES, _b64(epoch_bytes), db=meta)
        if evicted:
            total = _u64(txn.get(_EVICTED, db=meta)) + evicted
            txn.put(_EVICTED, _b64(total), db=meta)
        return stored, gone

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move ``keys`` (and their ancestors) to the current epoch: read, so in use."""

        def write() -> None:
            with self._env.begin(write=True) as txn:
                epoch = max(1, _u64(txn.get(_EPOCH, db=self._meta)))
                for key in keys:
                    self._order.refresh(txn, key, epoch)

        if keys:
            self._run(write)

    def take_evicted_keys(self) -> list[bytes]:
        out, self._evicted_keys = self._evicted_keys, []
        return out

    def remove(self, key: bytes) -> None:
        def write() -> None:
            with self._env.begin(write=True) as txn:
                old = txn.pop(key, db=self._records)
                if old is None:
                    return
                self._order.remove(txn, key)
                used = _u64(txn.get(_USED, db=self._meta)) - len(old)
                txn.put(_USED, _b64(used), db=self._meta)

        self._run(write)

    def clear(self) -> None:
        """Drop every record (the counters stay)."""

        def write() -> None:
            with self._env.begin(write=True) as txn:
                txn.drop(self._records, delete=False)
                txn.drop(self._order.blocks_db, delete=False)
                txn.drop(self._order.order_db, delete=False)
                txn.put(_USED, _b64(0), db=self._meta)

        self._run(write)

    def close(self) -> None:
        self._env.close()
