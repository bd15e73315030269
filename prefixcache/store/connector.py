"""A runtime's connection to a shared K/V store: the manager's existence query, the loads into
GPU blocks, and the write-through of computed blocks off the step's path.

    connector = KVStoreConnector(LMDBBlockStore("/dev/shm/kv"), kv)  # kv: a PagedKVCache
    mgr = CacheManager(num_blocks, block_size, stepped=True, store=connector)
    # each step: plan, then
    transfers = mgr.take_transfers()
    kv.start_transfers(transfers)                     # host tier
    requeue(mgr.abort_many(connector.load(transfers.store_loads)))  # loads that failed
    # forward pass, then
    mgr.end_step()
    connector.write_through(mgr.take_store_writes())  # copies the blocks out now

Nothing read from the store is used unchecked: every record's header and checksum are checked
(block_record.py) and a refused record is removed, so the next query no longer finds it. The
store may fail at any time (killed, restarted empty, full, slow to answer): a query that fails
finds nothing, a load that fails is recomputed, a write that fails is dropped; each is counted.

Writes go through a bounded queue to one background thread; when it is full, blocks are
dropped and counted, and the step never waits. The copy out of the GPU blocks happens in
``write_through`` itself, before the manager can hand the blocks out again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import Counter
from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from prefixcache.blocks.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.errors import ConfigError
from prefixcache.kv_cache import PagedKVCache
from prefixcache.manager.block_events import BlockRemoved, BlockStored, CacheEvent, EventListener
from prefixcache.manager.lower_tiers.transfers import StoreLoad, StoreWrite
from prefixcache.medium import STORE
from prefixcache.store.backend import (
    BlockPlace,
    KVBlockStore,
    StoreGate,
    StoreUnavailableError,
    leading_held,
)
from prefixcache.store.block_record import (
    BlockLayout,
    Refusal,
    encode_header,
    namespace_fingerprint,
    payload_checksum,
)

log = logging.getLogger("prefixcache.store")
_BATCH = 64  # records a background put sends at once
_SUSPECTS = 4096  # held records known or feared bad, kept to be replaced when written


class _Write(NamedTuple):
    """A block copied out, for the background writer."""

    digest: bytes
    namespace: Namespace
    record: np.ndarray
    place: BlockPlace


class _Touch(NamedTuple):
    """Blocks loaded: the store keeps blocks in use longer."""

    digests: list[bytes]


class StoreCounters(NamedTuple):
    """What the connector did since it started."""

    queries: int  # existence queries (one per admission)
    query_errors: int  # queries the store failed to answer (nothing found)
    found_blocks: int  # blocks the queries found
    loaded_blocks: int  # blocks loaded into GPU blocks
    refused: dict[str, int]  # loads refused, by reason (missing, checksum, layout, error, ...)
    queued_blocks: int  # blocks handed to the background writer
    written_blocks: int  # blocks the store took as new
    dropped_blocks: int  # blocks not written: the queue was full
    write_errors: int  # blocks not written: the store failed


def layout_of(kv: PagedKVCache) -> BlockLayout:
    """The record layout of ``kv``'s blocks: per layer, K and V of ``(block_size, heads,
    head_dim)`` in its storage dtype (fp8 caches store their bytes)."""
    k = kv.k[0]
    dtype = str(k.dtype).removeprefix("torch.")
    return BlockLayout(kv.block_size, kv.num_layers, dtype, k.element_size(), tuple(k.shape[1:]))


class KVStoreConnector:
    """Connects one ``PagedKVCache`` to a ``KVBlockStore``; pass it to ``CacheManager(store=)``.

    ``queue_blocks`` bounds the blocks waiting to be written (past it they are dropped). After
    the store fails to answer, it is left alone for ``retry_after`` seconds (queries find
    nothing, writes are dropped), so a store that is down costs the steps nothing.
    ``owns_backend``: ``close`` closes the store too."""

    def __init__(
        self,
        backend: KVBlockStore,
        kv: PagedKVCache,
        *,
        queue_blocks: int = 1024,
        retry_after: float = 2.0,
        owns_backend: bool = True,
    ):
        if not isinstance(backend, KVBlockStore):
            raise ConfigError(f"backend must be a KVBlockStore, got {backend!r}")
        if isinstance(queue_blocks, bool) or not isinstance(queue_blocks, int) or queue_blocks < 1:
            raise ConfigError(f"queue_blocks must be a positive int, got {queue_blocks!r}")
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not (0 <= retry_after < float("inf"))
        ):
            raise ConfigError(f"retry_after must be seconds >= 0, got {retry_after!r}")
        self.backend = backend
        self.kv = kv
        self.retry_after = float(retry_after)
        self.owns_backend = bool(owns_backend)
        self._gate = StoreGate(self.retry_after, "connector", log)
        self.layout = layout_of(kv).check()
        self._fps: dict[Namespace, bytes] = {}
        self._lock = threading.Lock()  # the counters, shared with the writer thread
        self._queries = self._query_errors = self._found = self._loaded = 0
        self._refused: Counter[str] = Counter()
        self._queued = self._written = self._dropped = self._write_errors = 0
        self._queue: queue.Queue[_Write | _Touch | None] = queue.Queue(queue_blocks)
        # digests whose held record must be replaced by the next write: refused ones that may
        # not have been removed, and the blocks a failed load never got to check
        self._suspects: dict[bytes, None] = {}
        self._listeners: list[EventListener] = []
        self._announce: list[CacheEvent] = []  # written or evicted since the last delivery
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-store-writer", daemon=True
        )
        self._writer.start()

    # ---- what the manager asks --------------------------------------------------------------
    def leading_present(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, the store holds (one query; 0 when the
        store fails to answer)."""
        held = self._gate.ask(partial(self.backend.exists, digests))
        n = 0 if held is None else leading_held(held)
        with self._lock:
            self._queries += 1
            self._query_errors += held is None
            self._found += n
        return n

    # ---- loads ------------------------------------------------------------------------------
    def load(self, loads: Sequence[StoreLoad]) -> list[Hashable]:
        """Load each block into its GPU block (every layer's K and V); returns the requests
        whose loads failed, each once, to abort and requeue with ``mgr.abort_many`` (their
        blocks are recomputed: a refused record was removed from the store, and the write that
        recomputes it replaces it). Run before the forward pass."""
        failed: dict[Hashable, Refusal] = {}
        if not loads:
            self._deliver()
            return []
        layout, kv = self.layout, self.kv
        rows = kv.host_rows(len(loads), layout.record_bytes)  # the records, fetched in place
        buf = rows.numpy()
        blocks: list[int] = []  # the GPU block of each record fetched
        fetched: list[bytes] = []  # and its digest
        for request_id, digest, gpu_block, namespace in loads:
            why = failed.get(request_id)
            if why is not None:
                if why not in (Refusal.MISSING, Refusal.ERROR):
                    self._suspect(digest)  # after a bad record: never checked
                continue
            reason = self._fetch(digest, namespace, buf[len(blocks)])
            if reason is not None:
                failed[request_id] = reason
                with self._lock:
                    self._refused[reason.value] += 1
                continue
            blocks.append(gpu_block)
            fetched.append(digest)
        if blocks:  # every layer's K and V of every block in one batch
            kv.write_block_rows(blocks, rows[: len(blocks)], layout.header_bytes)
            with self._lock:
                self._loaded += len(blocks)
            with contextlib.suppress(queue.Full):  # in use: kept longer (best effort)
                self._queue.put_nowait(_Touch(fetched))
        self._deliver()
        return list(failed)

    def _suspect(self, digest: bytes) -> None:
        """``digest``'s held record, if any, is replaced by the next write of it."""
        with self._lock:
            self._suspects[digest] = None
            if len(self._suspects) > _SUSPECTS:
                del self._suspects[next(iter(self._suspects))]

    def _fetch(self, digest: bytes, namespace: Namespace, out: np.ndarray) -> Refusal | None:
        """The record of ``digest`` into ``out``, checked; a refused one is removed."""
        reason = self._gate.read_checked(
            self.backend, digest, out, self._fp(namespace), self.layout
        )
        if reason in (None, Refusal.MISSING, Refusal.ERROR):
            return reason
        log.warning("store record %s refused (%s): recomputed", digest.hex(), reason.value)
        self._suspect(digest)  # if the removal fails (or races a rewrite), still replaced
        with contextlib.suppress(StoreUnavailableError):
            self.backend.remove(digest)
            if self._listeners:
                with self._lock:
                    self._announce.append(BlockRemoved([digest], namespace, STORE))
        return reason

    def _fp(self, namespace: Namespace) -> bytes:
        fp = self._fps.get(namespace)
        if fp is None:
            fp = self._fps[namespace] = namespace_fingerprint(namespace)
        return fp

    # ---- write-through ----------------------------------------------------------------------
    def write_through(self, writes: Sequence[StoreWrite]) -> None:
        """Copy the blocks out now (call right after ``end_step``) and queue them for the
        background writer; blocks that do not fit in the queue are dropped and counted."""
        self._deliver()
        if not writes:
            return
        kv, layout = self.kv, self.layout
        header = layout.header_bytes
        # the records' bytes, the payloads copied straight into place, every layer of every
        # block in one batch (the header is written by the writer thread, after the checksum)
        records = np.empty((len(writes), layout.record_bytes), dtype=np.uint8)
        blocks = [w.gpu_block for w in writes]
        kv.read_block_rows(blocks, torch.from_numpy(records), header)
        queued = dropped = 0
        for i, write in enumerate(writes):
            place = BlockPlace(write.parent, write.block_index)
            try:
                self._queue.put_nowait(_Write(write.digest, write.namespace, records[i], place))
                queued += 1
            except queue.Full:
                dropped += 1
        with self._lock:
            self._queued += queued
            self._dropped += dropped

    def _write_loop(self) -> None:
        """The background writer: records built and put in batches until ``close``."""
        layout = self.layout
        header = layout.header_bytes
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = []
            touched: list[bytes] = []
            spaces: dict[bytes, Namespace] = {}
            places: dict[bytes, BlockPlace] = {}
            for entry in batch:
                if isinstance(entry, _Touch):
                    touched += entry.digests
                    continue
                if entry is None:
                    continue
                digest, namespace, record, place = entry
                checksum = payload_checksum(record[header:])
                head = encode_header(digest, self._fp(namespace), layout, checksum)
                record[:header] = np.frombuffer(head, np.uint8)
                items.append((digest, record.data))
                spaces[digest] = namespace
                places[digest] = place
            if touched:  # the loaded blocks are in use (a failure only costs that)
                self._gate.ask(partial(self.backend.touch, touched))
            if items:
                self._put(items, spaces, places)
            for _ in batch:
                self._queue.task_done()
            if None in batch:
                return

    def _put(
        self,
        items: list[tuple[bytes, memoryview]],
        spaces: dict[bytes, Namespace],
        places: dict[bytes, BlockPlace],
    ) -> None:
        """One batch to the store: suspect records among them are replaced."""
        with self._lock:
            replace = [d for d, _ in items if d in self._suspects]
        backend = self.backend
        done = self._gate.ask(
            lambda: (
                backend.put_many(items, places=places, replace=replace),
                backend.take_evicted_keys(),
            )
        )
        if done is None:
            with self._lock:
                self._write_errors += len(items)
            return
        stored, evicted = done
        with self._lock:
            for digest in replace:
                self._suspects.pop(digest, None)
            self._written += stored
            if self._listeners:
                self._note_stored(spaces)
                if evicted:
                    self._announce.append(BlockRemoved(evicted, DEFAULT_NAMESPACE, STORE))

    # ---- announcements ----------------------------------------------------------------------
    def add_listener(self, listener: EventListener) -> None:
        """Call ``listener`` (a KV event publisher's) with ``BlockStored`` for blocks written
        to the store and ``BlockRemoved`` for blocks that left it (evicted by this process's
        writes, or refused), medium ``STORE``, on the runtime's thread: delivered by
        ``write_through`` and ``load``. A fleet service counts them as in reach of every
        replica attached to the store (``kv_store``)."""
        if not callable(listener):
            raise ConfigError(f"a listener must be callable, got {listener!r}")
        self._listeners.append(listener)

    def _note_stored(self, spaces: dict[bytes, Namespace]) -> None:
        """Announce what a put sent (held already or new: either way it is in the store), one
        event per namespace; called with the lock held."""
        by_space: dict[Namespace, list[bytes]] = {}
        for digest, namespace in spaces.items():
            by_space.setdefault(namespace, []).append(digest)
        for namespace, digests in by_space.items():
            block_size = self.layout.block_size
            self._announce.append(BlockStored(digests, None, [], block_size, namespace, STORE))

    def _deliver(self) -> None:
        """Hand the pending announcements to the listeners, on the caller's thread."""
        if not self._listeners:
            return
        with self._lock:
            events, self._announce = self._announce, []
        for event in events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:  # a listener must not stop the runtime
                    log.exception("store event listener failed")

    def flush(self) -> None:
        """Wait until every queued block has been written (or failed)."""
        self._queue.join()

    # ---- state --------------------------------------------------------------------------------
    def counters(self) -> StoreCounters:
        """The counts so far."""
        with self._lock:
            return StoreCounters(
                self._queries,
                self._query_errors,
                self._found,
                self._loaded,
                dict(self._refused),
                self._queued,
                self._written,
                self._dropped,
                self._write_errors,
            )

    def close(self) -> None:
        """Write what is queued, stop the writer and close the store (if it owns it)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self.owns_backend:
            self.backend.close()

    def __enter__(self) -> KVStoreConnector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
