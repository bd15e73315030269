"""The write-through of computed blocks, off the step's path.

The worker hands ``BlockWriter.take`` a step's computed blocks with a function that copies them
out of vLLM's cache (the step must do that before vLLM can hand the blocks out again); the
copies land in record buffers the writer recycles (slabs of several records, allocated once and
reused: a fresh buffer per step would cost a page fault per 4 KiB, more than the copy; a step
fills the rows the last one left, so steps of a few blocks each use the whole bound), and one
background thread checksums each payload, writes its header and puts the records in batches.
At most ``queue_blocks`` records wait at once: past it, blocks are dropped and counted, and the
step never waits (and at most ``queue_bytes`` of record buffers exist: the bound for large
records). Each write says where the block sits in its chain (a store that evicts by use
keeps chains whole, tails first) and whether a held record of it is to be replaced (one refused
or never checked after a refusal); the blocks a step loaded are reported as used (``touch``)
the same way. While the store is left alone after a failure (``StoreGate``), queued blocks are
dropped too. What the store took, and what it evicted to take it, is kept for the scheduler's
announcements (``take_outcome``). The thread runs at a lower priority and hands the interpreter
back between records, so an engine step waiting on either never waits for the writer.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np

from prefixcache.engines.store_tally import StoreTally
from prefixcache.store.backend import BlockPlace, KVBlockStore, StoreGate, StoreUnavailableError
from prefixcache.store.block_record import BlockLayout, encode_header, payload_checksum

_BATCH = 16  # records one put sends at once (the thread lets the step run between puts)
_NICE = 10  # the writer thread's niceness: the engine's own threads and processes go first
SLAB_BYTES = 8 << 20  # records of a slab together (one at least, 64 at most)

# block ids, and the slab's rows to fill (``[n, payload bytes]``, a view of the slab)
Filler = Callable[[list[int], np.ndarray], None]
# a block to write: vLLM's block id, its digest, its namespace's fingerprint, the digest before
# it in its chain (None: the first) and its index in the chain
Block = tuple[int, bytes, bytes, bytes | None, int]


class _Slab:
    """Record buffers allocated together, handed out a run of rows at a time (a step's blocks
    fill the rows the last step left); back to the pool once all its records are written."""

    def __init__(self, rows: int, record_bytes: int) -> None:
        self.records = np.empty((rows, record_bytes), np.uint8)
        # changed under the writer's lock:
        self.used = 0  # rows handed out since the slab was last empty
        self.pending = 0  # records handed out and not yet done


class _Item(NamedTuple):
    digest: bytes
    fingerprint: bytes
    place: BlockPlace  # the block before it in its chain, its index there
    replace: bool  # a held record of it is bad or unchecked: overwrite it
    slab: _Slab
    row: int


class _Touch(NamedTuple):
    digests: list[bytes]  # blocks just loaded


class WriteOutcome(NamedTuple):
    """What the writer did since it was last asked."""

    stored: list[bytes]  # digests now in the store (new, or held already)
    evicted: list[bytes]  # digests the store evicted to take them
    settled: int  # blocks handed over that are done: stored, held, dropped or failed


class BlockWriter:
    """Recycled record buffers, a queue of blocks, and the thread that writes them."""

    def __init__(
        self,
        store: KVBlockStore,
        layout: BlockLayout,
        tally: StoreTally,
        gate: StoreGate,
        queue_blocks: int = 1024,
        queue_bytes: int = 1 << 30,
    ) -> None:
        self.store = store
        self.layout = layout
        self.tally = tally
        self.gate = gate
        # records waiting at most: queue_blocks, and no more than queue_bytes of buffers
        self.bound = max(1, min(queue_blocks, queue_bytes // layout.record_bytes))
        self.rows = max(1, min(64, SLAB_BYTES // layout.record_bytes, self.bound))
        self._free: list[_Slab] = []
        self._filling: _Slab | None = None  # the slab whose next rows are handed out
        self._made = 0  # rows of the slabs made so far (at most bound)
        self._queue: queue.Queue[_Item | _Touch | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        self._settled = 0
        self._thread = threading.Thread(target=self._run, name="prefixcache-store-writer")
        self._thread.daemon = True
        self._thread.start()

    def take(self, blocks: Sequence[Block], fill: Filler, replace: Collection[bytes] = ()) -> None:
        """Copy ``blocks`` out with ``fill`` into record buffers and queue them, without
        waiting; blocks past the bound are dropped and counted. Held records of the digests in
        ``replace`` are overwritten."""
        header = self.layout.header_bytes
        done = 0
        while done < len(blocks):
            rows = self._rows(len(blocks) - done)
            if rows is None:
                break
            slab, first, n = rows
            chunk = blocks[done : done + n]
            fill([b[0] for b in chunk], slab.records[first : first + n, header:])
            for row, (_, digest, fingerprint, parent, index) in enumerate(chunk, first):
                place = BlockPlace(parent, index)
                self._queue.put(_Item(digest, fingerprint, place, digest in replace, slab, row))
            done += n
        dropped = len(blocks) - done
        self.tally.add("queued_blocks", done)
        if dropped:
            self.tally.add("dropped_blocks", dropped)
            with self._lock:
                self._settled += dropped

    def _rows(self, wanted: int) -> tuple[_Slab, int, int] | None:
        """Up to ``wanted`` free rows in one slab, as (slab, first row, count), held for the
        caller to fill; None when every row the bound allows is taken."""
        with self._lock:
            slab = self._filling
            if slab is None or slab.used == len(slab.records):
                if self._free:
                    slab = self._free.pop()
                elif self._made < self.bound:
                    rows = min(self.rows, self.bound - self._made)
                    self._made += rows
                    slab = _Slab(rows, self.layout.record_bytes)
                else:
                    return None
                self._filling = slab
            first = slab.used
            n = min(wanted, len(slab.records) - first)
            slab.used += n
            slab.pending += n
        return slab, first, n

    def touch(self, digests: list[bytes]) -> None:
        """Tell the store, off the step's path, that these blocks were just loaded (a store
        that evicts by use keeps them longer)."""
        self._queue.put(_Touch(digests))

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
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if isinstance(b, _Item)]
            touched = [d for b in batch if isinstance(b, _Touch) for d in b.digests]
            if touched and self.gate.is_open():
                with contextlib.suppress(StoreUnavailableError):  # only costs the use order
                    self.store.touch(touched)
            if items:
                self._write(items)
                self._done(items)
            for _ in batch:
                self._queue.task_done()
            os.sched_yield()  # hand the interpreter back at once (else up to its switch interval)
            if None in batch:
                return

    def _write(self, items: list[_Item]) -> None:
        if not self.gate.is_open():
            self.tally.add("dropped_blocks", len(items))
            return
        header = self.layout.header_bytes
        puts = []
        for item in items:
            record = item.slab.records[item.row]
            os.sched_yield()  # between records too: a step waiting on the interpreter goes first
            checksum = payload_checksum(record[header:])
            head = encode_header(item.digest, item.fingerprint, self.layout, checksum)
            record[:header] = np.frombuffer(head, np.uint8)
            puts.append((item.digest, record.data))
        places = {item.digest: item.place for item in items}
        replace = {item.digest for item in items if item.replace}
        try:
            stored = self.store.put_many(puts, places=places, replace=replace)
            evicted = self.store.take_evicted_keys()
        except StoreUnavailableError as exc:
            self.gate.failed(exc)
            self.tally.add("write_errors", len(puts))
            return
        self.tally.add("written_blocks", stored)
        self.tally.add("evicted_blocks", len(evicted))
        with self._lock:
            self._stored.extend(item.digest for item in items)
            self._evicted.extend(evicted)

    def _done(self, items: list[_Item]) -> None:
        """The items are settled: their slabs go back to the pool once empty."""
        with self._lock:
            self._settled += len(items)
            for item in items:
                slab = item.slab
                slab.pending -= 1
                if slab.pending == 0:  # every row handed out is written: all free again
                    slab.used = 0
                    if slab is not self._filling:
                        self._free.append(slab)
