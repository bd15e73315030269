"""The connector's scheduler side: how much of a prompt the store can give, which blocks to load
and to write each step, and the KV events that announce the store's blocks.

- ``matched_tokens`` keys the prompt's full blocks (connector_keys.py) and asks the store about
  the blocks past vLLM's own hit in one batched ``exists`` per request (kept for the request's
  later calls); the leading run found is offered to vLLM, leaving at least the prompt's last
  token to compute, as vLLM requires.
- ``after_alloc`` turns what vLLM accepted into loads into the blocks it allocated.
- ``build_plan`` adds, for every scheduled request, the prompt blocks that become full in the
  step and that it computes (past vLLM's hit and the store's load), unless the query found them
  in the store already: the worker writes them through after the forward pass.
- ``worker_report`` reads what the workers' writes did: blocks the store took are announced
  ``BlockStored`` with medium ``STORE``, blocks it evicted or refused ``BlockRemoved``, by
  vLLM's own block hashes (the service maps them to the blocks vLLM announced on its GPU);
  ``take_events`` hands them to vLLM's event publisher. A digest's vLLM hash is remembered for
  the blocks this scheduler saw (bounded), so the evictions of other servers' blocks that it
  did not see cannot be announced (they are counted).
- ``has_pending_writes``: blocks handed to the writer and not settled keep vLLM stepping, so
  their announcements go out without waiting for the next request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from prefixcache.engines.store_tally import StoreTally
from prefixcache.engines.vllm.connector_keys import PromptKeyMaker, PromptKeys, request_namespace
from prefixcache.engines.vllm.connector_plan import (
    BlockMove,
    RequestBlocks,
    StoreStepPlan,
    StoreWorkerReport,
)
from prefixcache.engines.vllm.connector_tally import LOGGER
from prefixcache.medium import STORE
from prefixcache.store.backend import KVBlockStore, StoreGate, leading_held

log = logging.getLogger(LOGGER)
KNOWN_HASHES = 1 << 16  # digests whose vLLM block hash is remembered for announcements


@dataclass
class _Tracked:
    """What the scheduler side knows of one request."""

    request: Any  # vLLM's Request
    keys: PromptKeys | None  # None: not keyed (multimodal, prompt embeddings)
    queried_from: int = 0  # the first block the store was asked about
    present: list[bool] | None = None  # its answer, from ``queried_from``
    match_from: int = 0  # the first block of the last offer


class StoreScheduler:
    """The scheduler process's view of the store for one vLLM engine."""

    def __init__(
        self,
        store: KVBlockStore,
        tally: StoreTally,
        *,
        block_size: int,
        model: str,
        weights: str | None,
        extra: tuple[str, ...],
        hash_algo: str,
        retry_after: float,
    ) -> None:
        self.store = store
        self.tally = tally
        self.block_size = block_size
        self.model = model
        self.weights = weights
        self.extra = extra
        self.keys = PromptKeyMaker(block_size, hash_algo)
        self.gate = StoreGate(retry_after, "scheduler", log)
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[RequestBlocks] = []
        self._in_flight = 0  # blocks handed to the writer, not yet settled
        self._writing: dict[bytes, Any] = {}  # digest -> vLLM hash, until the store takes it
        self._known: OrderedDict[bytes, Any] = OrderedDict()  # digest -> vLLM hash
        self._events: list[KVCacheEvent] = []

    # ---- what vLLM asks before allocating ------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block aligned) the store can give ``request``."""
        tracked = self._track(request)
        keys = tracked.keys
        if keys is None:
            return 0
        bs = self.block_size
        limit = min(len(keys.digests), (request.num_tokens - 1) // bs)
        first = num_computed_tokens // bs
        tracked.match_from = first
        if first >= limit:
            return 0
        present = tracked.present
        if present is None or first < tracked.queried_from:
            present = tracked.present = self._query(keys.digests[first:limit])
            tracked.queried_from = first
        n = 0
        for held in present[first - tracked.queried_from : limit - tracked.queried_from]:
            if not held:
                break
            n += 1
        if n:
            self._remember(request, range(first, first + n), keys)
        return n * bs

    def _track(self, request: Any) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.request is not request:
            namespace = request_namespace(self.model, self.weights, self.extra, request)
            keys = None
            if namespace is not None:
                keys = self.keys.keys(namespace, request.prompt_token_ids)
            tracked = self._requests[request.request_id] = _Tracked(request, keys)
        return tracked

    def _query(self, digests: Sequence[bytes]) -> list[bool]:
        """Which of ``digests`` the store holds (none, when it fails or is left alone)."""
        self.tally.add("queries")
        self.tally.add("queried_blocks", len(digests))
        held = self.gate.ask(partial(self.store.exists, digests))
        if held is None:
            self.tally.add("query_errors")
            return [False] * len(digests)
        self.tally.add("found_blocks", leading_held(held))
        return list(held)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated ``request``'s blocks and takes ``num_external_tokens`` from the
        store: plan their loads."""
        if num_external_tokens <= 0:
            return
        tracked = self._requests[request.request_id]
        assert tracked.keys is not None
        block_ids = blocks.get_block_ids()[0]
        first, n = tracked.match_from, num_external_tokens // self.block_size
        keys = tracked.keys
        moves = [_move(block_ids[j], keys, j) for j in range(first, first + n)]
        self._loads.append(RequestBlocks(request.request_id, moves))

    # ---- each step ----------------------------------------------------------------------
    def build_plan(self, scheduler_output: Any, block_ids_of: Any) -> StoreStepPlan:
        """The step's loads and writes; ``block_ids_of(request_id)`` gives a scheduled
        request's current blocks."""
        scheduled = scheduler_output.num_scheduled_tokens
        saves: list[RequestBlocks] = []
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_saves(
                new.req_id, new.num_computed_tokens, scheduled[new.req_id], new.block_ids[0], saves
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.keys is None:
                continue
            computed = cached.num_computed_tokens[i]
            if computed // self.block_size >= len(tracked.keys.digests):
                continue  # decoding: nothing of the prompt left to write
            self._plan_saves(req_id, computed, scheduled[req_id], block_ids_of(req_id), saves)
        plan = StoreStepPlan(self._loads, saves)
        self._loads = []
        self._in_flight += sum(len(r.blocks) for r in saves)
        return plan

    def _plan_saves(
        self,
        req_id: str,
        num_computed: int,
        num_scheduled: int,
        block_ids: Sequence[int],
        out: list[RequestBlocks],
    ) -> None:
        tracked = self._requests.get(req_id)
        if tracked is None or tracked.keys is None:
            return
        keys, bs = tracked.keys, self.block_size
        end = min(num_computed + num_scheduled, len(keys.digests) * bs) // bs
        present, base = tracked.present or [], tracked.queried_from
        hashes = tracked.request.block_hashes
        moves = []
        for j in range(num_computed // bs, end):
            if 0 <= j - base < len(present) and present[j - base]:
                continue  # the store has it
            digest = keys.digests[j]
            moves.append(_move(block_ids[j], keys, j))
            if j < len(hashes):
                self._writing[digest] = maybe_convert_block_hash(hashes[j])
        if moves:
            out.append(RequestBlocks(req_id, moves))

    def _remember(self, request: Any, blocks: range, keys: PromptKeys) -> None:
        """Remember the vLLM hashes of ``blocks`` of ``request`` (found in the store)."""
        hashes = request.block_hashes
        for j in blocks:
            if j < len(hashes):
                self._note(keys.digests[j], maybe_convert_block_hash(hashes[j]))

    def _note(self, digest: bytes, engine_hash: Any) -> None:
        known = self._known
        known[digest] = engine_hash
        known.move_to_end(digest)
        if len(known) > KNOWN_HASHES:
            known.popitem(last=False)

    # ---- what the workers did -------------------------------------------------------------
    def worker_report(self, report: StoreWorkerReport) -> None:
        """Announce what the store took, evicted and refused."""
        self._in_flight = max(0, self._in_flight - report.settled)
        stored = []
        for digest in report.stored:
            engine_hash = self._writing.pop(digest, None)
            if engine_hash is not None:
                self._note(digest, engine_hash)
                stored.append(engine_hash)
        if stored:
            self._events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=STORE,
                    lora_name=None,
                )
            )
        gone = []
        for digest in [*report.evicted, *report.refused]:
            engine_hash = self._known.pop(digest, None)
            if engine_hash is None:
                self.tally.add("unannounced_removals")
            else:
                gone.append(engine_hash)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=STORE))
        if not self._in_flight:
            self._writing.clear()  # the rest were dropped or failed: never in the store
        if report.unloaded:
            self._forget_present(set(report.unloaded))

    def _forget_present(self, digests: set[bytes]) -> None:
        """Blocks that failed to load are not in the store for the requests that asked: vLLM
        computes them, and they are written again."""
        for tracked in self._requests.values():
            if tracked.keys is None or tracked.present is None:
                continue
            for j, digest in enumerate(tracked.keys.digests):
                if digest in digests and 0 <= j - tracked.queried_from < len(tracked.present):
                    tracked.present[j - tracked.queried_from] = False

    def take_events(self) -> list[KVCacheEvent]:
        """The announcements since the last call."""
        out, self._events = self._events, []
        return out

    def has_pending_writes(self) -> bool:
        """Whether blocks handed to the writer are not settled yet."""
        return self._in_flight > 0

    def finished(self, request: Any) -> None:
        """``request`` is done: forget it."""
        self._requests.pop(request.request_id, None)


def _move(block_id: int, keys: PromptKeys, j: int) -> BlockMove:
    """Block ``j`` of a prompt, in vLLM's block ``block_id``."""
    parent = keys.digests[j - 1] if j else None
    return BlockMove(block_id, keys.digests[j], keys.fingerprint, parent, j)
