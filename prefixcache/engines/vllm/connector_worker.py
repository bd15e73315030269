"""The connector's worker side: checked loads into vLLM's paged K/V before the forward pass,
and the copy-out of computed blocks after it, handed to the background writer.

A load reads each record into a staging buffer and checks it as the store's own connector does
(``check_record``: digest, namespace fingerprint, layout, length, xxh3-128 checksum of the
payload); only records that pass are copied into vLLM's blocks. At a request's first block that
does not pass (missing, refused, or the store failed), that block and every later one of the
request are left unloaded and reported to vLLM (``get_block_ids_with_load_errors``), which, with
``kv_load_failure_policy: recompute``, computes them: a K/V byte that was not checked is never
used. A refused record is removed from the store, counted by reason and logged. The same step's
writes of that request are skipped (their K/V was computed over the blocks that failed).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import numpy as np
import torch

from prefixcache.engines.store_tally import StoreTally
from prefixcache.engines.vllm.connector_layout import PagedKV
from prefixcache.engines.vllm.connector_plan import (
    BlockMove,
    RequestBlocks,
    StoreStepPlan,
    StoreWorkerReport,
)
from prefixcache.engines.vllm.connector_tally import LOGGER
from prefixcache.engines.vllm.connector_writer import BlockWriter
from prefixcache.store.backend import KVBlockStore, StoreGate, StoreUnavailableError
from prefixcache.store.block_record import Refusal

log = logging.getLogger(LOGGER)
STAGING_BYTES = 64 << 20  # records read per batch at most (one record at least)
SUSPECTS = 4096  # digests of held records to replace, kept at most


class StoreWorker:
    """Moves blocks between one worker's vLLM cache and the store."""

    def __init__(
        self,
        store: KVBlockStore,
        tally: StoreTally,
        retry_after: float,
        queue_blocks: int,
        queue_bytes: int = 1 << 30,
    ) -> None:
        self.store = store
        self.tally = tally
        self.gate = StoreGate(retry_after, "worker", log)
        self.queue_blocks = queue_blocks
        self.queue_bytes = queue_bytes
        self.kv: PagedKV | None = None
        self.writer: BlockWriter | None = None
        self._staging = np.empty((0, 0), np.uint8)
        self._errors: set[int] = set()  # vLLM blocks not loaded, to report
        self._failed: set[str] = set()  # requests with a failed load this step
        self._refused: list[bytes] = []
        self._unloaded: list[bytes] = []
        self._suspects: dict[bytes, None] = {}  # held records to replace when written
        self._dropped = 0  # blocks settled before reaching the writer, not yet reported

    def register(self, kv: PagedKV) -> None:
        """Take vLLM's cache tensors (``PagedKV`` checked their layout) and start the writer."""
        self.kv = kv
        layout = kv.layout
        rows = max(1, STAGING_BYTES // layout.record_bytes)
        self._staging = np.empty((rows, layout.record_bytes), np.uint8)
        self.writer = BlockWriter(
            self.store, layout, self.tally, self.gate, self.queue_blocks, self.queue_bytes
        )

    # ---- loads -----------------------------------------------------------------------------
    def load(self, plan: StoreStepPlan) -> None:
        """Load every block the plan names, checked; failures are kept for the report."""
        self._failed.clear()
        loaded_digests: list[bytes] = []
        for request in plan.loads:
            loaded, why = self._load_request(request)
            loaded_digests += [b.digest for b in request.blocks[:loaded]]
            if loaded < len(request.blocks):
                self._failed.add(request.request_id)
                missed = request.blocks[loaded:]
                if why in (Refusal.MISSING, Refusal.ERROR):
                    self._unloaded.append(missed[0].digest)
                else:  # after a bad record: the ones after it were never checked either
                    self._unloaded += [b.digest for b in missed]
                    self._suspect(b.digest for b in missed)
                self._errors.update(b.block_id for b in missed)
                self.tally.add("load_failed_blocks", len(missed))
            self.tally.add("loaded_blocks", loaded)
        if loaded_digests and self.writer is not None:
            self.writer.touch(loaded_digests)  # in use: the store keeps them longer

    def _suspect(self, digests: Iterable[bytes]) -> None:
        """Held records of ``digests`` are replaced by the next write of them (refused ones
        whose removal may have failed or raced a rewrite, and ones never checked)."""
        for digest in digests:
            self._suspects[digest] = None
        while len(self._suspects) > SUSPECTS:
            del self._suspects[next(iter(self._suspects))]

    def _load_request(self, request: RequestBlocks) -> tuple[int, Refusal | None]:
        """How many leading blocks of ``request`` were loaded, and why the next one was
        not."""
        assert self.kv is not None
        header = self.kv.layout.header_bytes
        staging = self._staging
        done = 0
        while done < len(request.blocks):
            chunk = request.blocks[done : done + len(staging)]
            good = 0
            for i, block in enumerate(chunk):
                why = self._fetch(block, staging[i])
                if why is not None:
                    break
                good += 1
            if good:
                rows = torch.from_numpy(staging[:good, header:])
                self.kv.scatter([b.block_id for b in chunk[:good]], self.kv.payloads(rows))
            done += good
            if good < len(chunk):
                return done, why
        return done, None

    def _fetch(self, block: BlockMove, row: np.ndarray) -> Refusal | None:
        """The record of ``block`` into ``row``, checked (None: usable); a refused record is
        removed from the store."""
        assert self.kv is not None
        layout = self.kv.layout
        reason = self.gate.read_checked(self.store, block.digest, row, block.fingerprint, layout)
        if reason is None:
            return None
        self.tally.add(f"refused_{reason.value}")
        if reason not in (Refusal.MISSING, Refusal.ERROR):
            log.warning("store record %s refused (%s): computed", block.digest.hex(), reason.value)
            with contextlib.suppress(StoreUnavailableError):
                self.store.remove(block.digest)
                self._refused.append(block.digest)
        return reason

    def take_load_errors(self) -> set[int]:
        """vLLM blocks that were to be loaded and were not, since the last call."""
        out, self._errors = self._errors, set()
        return out

    # ---- writes ----------------------------------------------------------------------------
    def save(self, plan: StoreStepPlan) -> None:
        """Copy the plan's computed blocks out now and queue them for the writer. Blocks of a
        request whose load failed this step are not written (vLLM computes them again) and
        count as settled at once, as do blocks dropped while the store is left alone."""
        failed, self._failed = self._failed, set()
        moves = [b for r in plan.saves if r.request_id not in failed for b in r.blocks]
        skipped = sum(len(r.blocks) for r in plan.saves) - len(moves)
        self._dropped += skipped
        self.tally.add("skipped_blocks", skipped)
        if not moves:
            return
        assert self.kv is not None and self.writer is not None
        if not self.gate.is_open():
            self.tally.add("dropped_blocks", len(moves))
            self._dropped += len(moves)
            return
        kv = self.kv

        def fill(block_ids: list[int], rows: np.ndarray) -> None:
            kv.gather(block_ids, kv.payloads(torch.from_numpy(rows)))

        replace = {b.digest for b in moves if b.digest in self._suspects}
        self.writer.take(moves, fill, replace)
        for digest in replace:
            self._suspects.pop(digest, None)

    def report(self) -> StoreWorkerReport | None:
        """What the store traffic did since the last report (None: nothing)."""
        settled, self._dropped = self._dropped, 0
        refused, self._refused = self._refused, []
        unloaded, self._unloaded = self._unloaded, []
        stored: list[bytes] = []
        evicted: list[bytes] = []
        if self.writer is not None:
            outcome = self.writer.take_outcome()
            stored, evicted, settled = outcome.stored, outcome.evicted, settled + outcome.settled
        report = StoreWorkerReport(stored, evicted, refused, unloaded, settled)
        return None if report.is_empty() else report

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        if self.writer is not None:
            self.writer.close()
