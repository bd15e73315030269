"""The one-host store: LMDB on a memory-backed path, shared by every process that opens it.

LMDB (a B-tree in one memory-mapped file) is made for many processes at once: readers never
block, writers take turns under its own lock, and a transaction is visible whole or not at all,
so a writer killed mid-put leaves nothing behind (and every record carries its checksum as
well). On a tmpfs path (``/dev/shm``) a get is a B-tree lookup and one copy out of the shared
page cache.

The size bound is ``capacity_bytes`` of records; past it the oldest records go first (insertion
order, kept in two small tables: sequence number -> key and key -> sequence number), counted in
``evicted()``, which every process sees. The map is sized above the bound for the B-tree's
pages and the pages that open read transactions still pin.

A record is stored as it is given (one copy into the map). A new store's first fill is slower
than its steady state: every page it writes is a first touch of tmpfs memory; once at its
bound, it writes into pages its evictions freed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.store.backend import KVBlockStore, StoreUnavailableError

_SEQ = b"seq"
_USED = b"used"
_EVICTED = b"evicted"
DEFAULT_PATH = "/dev/shm/prefixcache-kv"


def _u64(value: bytes | memoryview | None) -> int:
    return int.from_bytes(bytes(value), "little") if value is not None else 0


class LMDBBlockStore(KVBlockStore):
    """Block records in an LMDB environment at ``path`` (a directory; created), holding at
    most ``capacity_bytes`` of records."""

    name = "lmdb"

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_PATH, capacity_bytes: int = 1 << 30):
        try:
            import lmdb
        except ImportError:
            raise ConfigError(
                "the one-host K/V store needs lmdb: pip install 'prefixcache[store]'"
            ) from None
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes < 1 << 20:
            raise ConfigError(f"capacity_bytes must be at least 1 MiB, got {capacity_bytes}")
        self._lmdb = lmdb
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path),
                map_size=capacity_bytes + capacity_bytes // 2 + (64 << 20),
                max_dbs=4,
                writemap=True,
                sync=False,  # memory-backed: nothing to flush, and a crash loses only a cache
                metasync=False,
                readahead=False,
                max_readers=512,
            )
            self._records = self._env.open_db(b"records")
            self._order = self._env.open_db(b"order")
            self._seqs = self._env.open_db(b"seqs")
            self._evicted_keys: list[bytes] = []  # by this process's writes, not yet taken
            self._meta = self._env.open_db(b"meta")
        except (OSError, lmdb.Error) as exc:
            raise ConfigError(f"cannot open the K/V store at {self.path}: {exc}") from None

    # ---- reads ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._env.begin(db=self._records, buffers=True) as txn:
                return [txn.get(k) is not None for k in keys]
        except self._lmdb.Error as exc:
            raise StoreUnavailableError(f"lmdb: {exc}") from exc

    def get_into(self, key: bytes, out: memoryview) -> int | None:
        try:
            with self._env.begin(db=self._records, buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    return None
                n = len(value)
                if n <= len(out):
                    out[:n] = value  # one copy out of the shared map
                return n
        except self._lmdb.Error as exc:
            raise StoreUnavailableError(f"lmdb: {exc}") from exc

    def evicted(self) -> int:
        with self._env.begin(db=self._meta) as txn:
            return _u64(txn.get(_EVICTED))

    def used_bytes(self) -> int:
        """Record bytes held now."""
        with self._env.begin(db=self._meta) as txn:
            return _u64(txn.get(_USED))

    def keys(self) -> list[bytes]:
        """Every key held now, oldest first."""
        with self._env.begin(db=self._order) as txn:
            return [bytes(v) for v in txn.cursor().iternext(keys=False, values=True)]

    def __len__(self) -> int:
        with self._env.begin(db=self._records) as txn:
            return int(txn.stat(self._records)["entries"])

    # ---- writes -----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        lmdb = self._lmdb
        for attempt in (0, 1):
            try:
                with self._env.begin(write=True) as txn:
                    stored, gone = self._put(txn, items, spare=attempt * self.capacity_bytes // 8)
                self._evicted_keys += gone  # committed
                return stored
            except lmdb.MapFullError:
                continue  # the B-tree outgrew the slack: evict more and try once again
            except lmdb.Error as exc:
                raise StoreUnavailableError(f"lmdb: {exc}") from exc
        raise StoreUnavailableError("lmdb: the map is full even after evicting")

    def _put(
        self, txn: Any, items: Sequence[tuple[bytes, bytes | memoryview]], spare: int
    ) -> tuple[int, list[bytes]]:
        """Insert what is new, evicting the oldest records first to stay ``spare`` bytes
        under the bound; returns how many were stored and the keys evicted."""
        seq = _u64(txn.get(_SEQ, db=self._meta))
        used = _u64(txn.get(_USED, db=self._meta))
        evicted = 0
        stored = 0
        gone: list[bytes] = []
        order = txn.cursor(db=self._order)
        for key, value in items:
            size = len(value)
            if size > self.capacity_bytes or txn.get(key, db=self._records) is not None:
                continue
            while used + size > self.capacity_bytes - spare and order.first():
                old_key = bytes(order.value())
                old = txn.pop(old_key, db=self._records)
                txn.delete(old_key, db=self._seqs)
                if old is not None:
                    used -= len(old)
                    evicted += 1
                    gone.append(old_key)
                order.delete()
            seq += 1
            tag = seq.to_bytes(8, "big")  # big-endian: the order table iterates oldest first
            txn.put(key, value, db=self._records)
            txn.put(key, tag, db=self._seqs)
            txn.put(tag, key, db=self._order)
            used += size
            stored += 1
        txn.put(_SEQ, seq.to_bytes(8, "little"), db=self._meta)
        txn.put(_USED, max(0, used).to_bytes(8, "little"), db=self._meta)
        if evicted:
            total = _u64(txn.get(_EVICTED, db=self._meta)) + evicted
            txn.put(_EVICTED, total.to_bytes(8, "little"), db=self._meta)
        return stored, gone

    def take_evicted_keys(self) -> list[bytes]:
        out, self._evicted_keys = self._evicted_keys, []
        return out

    def remove(self, key: bytes) -> None:
        try:
            with self._env.begin(write=True) as txn:
                old = txn.pop(key, db=self._records)
                if old is None:
                    return
                tag = txn.pop(key, db=self._seqs)
                if tag is not None:
                    txn.delete(tag, db=self._order)
                used = _u64(txn.get(_USED, db=self._meta)) - len(old)
                txn.put(_USED, max(0, used).to_bytes(8, "little"), db=self._meta)
        except self._lmdb.Error as exc:
            raise StoreUnavailableError(f"lmdb: {exc}") from exc

    def clear(self) -> None:
        """Drop every record (the counters stay)."""
        with self._env.begin(write=True) as txn:
            txn.drop(self._records, delete=False)
            txn.drop(self._order, delete=False)
            txn.drop(self._seqs, delete=False)
            txn.put(_USED, (0).to_bytes(8, "little"), db=self._meta)

    def close(self) -> None:
        self._env.close()
