"""The write-through of computed blocks, off the step's path.

The worker copies a step's computed blocks out of vLLM's cache into record buffers (the step
must do that before vLLM can hand the blocks out again), then ``BlockWriter.submit`` queues
them for one background thread, which checksums each payload, writes its header and puts the
records in batches. The queue holds at most ``queue_blocks`` blocks: past it, blocks are
dropped and counted, and the step never waits. While the store is left alone after a failure
(``StoreGate``), queued blocks are dropped too. What the store took, and what it evicted to take
it, is kept for the scheduler's announcements (``take_outcome``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from prefixcache.engines.store_tally import StoreGate, StoreTally
from prefixcache.store.backend import KVBlockStore, StoreUnavailableError
from prefixcache.store.block_record import BlockLayout, encode_header, payload_checksum

_BATCH = 64  # records one put sends at once


class PendingBlock(NamedTuple):
    """One block to write: its digest, its namespace's fingerprint, its record buffer (the
    payload filled in, the header still to write)."""

    digest: bytes
    fingerprint: bytes
    record: np.ndarray


class WriteOutcome(NamedTuple):
    """What the writer did since it was last asked."""

    stored: list[bytes]  # digests now in the store (new, or held already)
    evicted: list[bytes]  # digests the store evicted to take them
    settled: int  # blocks handed over that are done: stored, held, dropped or failed


class BlockWriter:
    """A bounded queue of blocks and the thread that writes them to ``store``."""

    def __init__(
        self,
        store: KVBlockStore,
        layout: BlockLayout,
        tally: StoreTally,
        gate: StoreGate,
        queue_blocks: int = 1024,
    ) -> None:
        self.store = store
        self.layout = layout
        self.tally = tally
        self.gate = gate
        self._queue: queue.Queue[PendingBlock | None] = queue.Queue(queue_blocks)
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        self._settled = 0
        self._thread = threading.Thread(target=self._run, name="prefixcache-store-writer")
        self._thread.daemon = True
        self._thread.start()

    def submit(self, blocks: Sequence[PendingBlock]) -> None:
        """Queue ``blocks`` without waiting; those that do not fit are dropped and counted."""
        queued = 0
        for block in blocks:
            try:
                self._queue.put_nowait(block)
            except queue.Full:
                break
            queued += 1
        dropped = len(blocks) - queued
        self.tally.add("queued_blocks", queued)
        self.tally.add("dropped_blocks", dropped)
        if dropped:
            with self._lock:
                self._settled += dropped

    def take_outcome(self) -> WriteOutcome:
        """The digests stored and evicted, and the blocks settled, since the last call."""
        with self._lock:
            out = WriteOutcome(self._stored, self._evicted, self._settled)
            self._stored, self._evicted, self._settled = [], [], 0
        return out

    def flush(self) -> None:
        """Wait until every queued block is written, dropped or failed."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        header = self.layout.header_bytes
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            blocks = [b for b in batch if b is not None]
            if blocks:
                self._write(blocks, header)
            for _ in batch:
                self._queue.task_done()
            if len(blocks) < len(batch):
                return

    def _write(self, blocks: list[PendingBlock], header: int) -> None:
        if not self.gate.is_open():
            self.tally.add("dropped_blocks", len(blocks))
            with self._lock:
                self._settled += len(blocks)
            return
        items = []
        for digest, fingerprint, record in blocks:
            checksum = payload_checksum(record[header:])
            head = encode_header(digest, fingerprint, self.layout, checksum)
            record[:header] = np.frombuffer(head, np.uint8)
            items.append((digest, record.data))
        try:
            stored = self.store.put_many(items)
            evicted = self.store.take_evicted_keys()
        except StoreUnavailableError as exc:
            self.gate.failed(exc)
            self.tally.add("write_errors", len(items))
            with self._lock:
                self._settled += len(items)
            return
        self.tally.add("written_blocks", stored)
        self.tally.add("evicted_blocks", len(evicted))
        with self._lock:
            self._stored.extend(b.digest for b in blocks)
            self._evicted.extend(evicted)
            self._settled += len(items)
