"""The manager's side of a shared K/V store below the host tier: which blocks an admission
finds there, the loads and write-throughs to run, and the step they belong to.

The manager holds no K/V and no store connection. It asks one question per admission, through
``BlockPresence.leading_present``: of the digests that continue the prompt past its GPU and
host hits, how many, from the first, does the store hold? Those blocks are loaded into GPU
blocks (``StoreLoad``, handed out by ``take_transfers`` with the host tier's) when loading beats
recomputing them (``TransferModel`` with the store's bandwidth), counted in ``cached_len`` and
indexed like computed ones. The full prompt blocks the admission computes are written through
(``StoreWrite``) once the step that computes them has ended: ``take_store_writes`` after
``end_step``. A request taken out by ``abort`` takes its writes with it.

The store is shared with other processes, so what it held at the query may be gone at the
load: the runtime that cannot load a block aborts the requests whose ``StoreLoad`` it was (and
requeues them); the next query no longer finds it, and the blocks are computed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple, Protocol

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.lower_tiers.transfers import StoreLoad, StoreWrite, TransferModel
from prefixcache.manager.stats import CacheStats

_new = tuple.__new__


class BlockPresence(Protocol):
    """The store's existence query, as the manager sees it."""

    def leading_present(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, the store holds now (one batched query;
        the count stops at the first block it does not hold)."""
        ...


class StoreRun(NamedTuple):
    """What an admission finds in the store after its GPU and host hits."""

    digests: list[bytes]  # the blocks to load, in chain order (empty: recompute them all)
    found: int  # blocks found in the store (more than loaded when recomputing is cheaper)
    computed: list[bytes]  # digests of the full prompt blocks after the loaded ones


class StoreTier:
    """Plans store loads and write-throughs for one manager (its counters are the state's)."""

    __slots__ = (
        "_head",
        "_memo",
        "block_size",
        "hasher",
        "loads",
        "pending",
        "presence",
        "ready",
        "stats",
        "transfer_model",
    )

    def __init__(
        self,
        hasher: BlockHasher,
        stats: CacheStats,
        presence: BlockPresence,
        transfer_model: TransferModel | None,
    ) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.stats = stats
        self.presence = presence
        self.transfer_model = transfer_model  # None: load every block found
        self.loads: list[StoreLoad] = []  # since the last take_transfers()
        self.pending: list[tuple[Hashable, list[StoreWrite]]] = []  # this step's, per request
        self.ready: list[StoreWrite] = []  # ended steps', until take_store_writes()
        self._memo: tuple[Namespace, bytes, int, int] | None = None  # the last query this step
        # the first block the last find_run leaves to compute: (digest, chain index, parent)
        self._head: tuple[bytes, int, bytes | None] | None = None

    def find_run(
        self, buf: bytes, num_tokens: int, start: int, prev: bytes, namespace: Namespace
    ) -> StoreRun:
        """The stored blocks that continue a prompt cached up to block ``start`` (``prev``:
        the digest of block ``start - 1``, the seed when 0), at most ``(num_tokens-1) //
        block_size`` blocks in all; the digests of every full block from ``start`` on are
        computed once, for the query, the index and the write-through."""
        p = self.block_size
        full = num_tokens // p
        self._head = None
        if start >= full:
            return _new(StoreRun, ([], 0, []))
        digests = self.hasher.hash_buffer(buf, prev, start, full)
        parent = prev if start else None  # the seed is no block
        end = (num_tokens - 1) // p - start  # blocks that may be loaded
        if end <= 0:
            self._head = (digests[0], start, parent)
            return _new(StoreRun, ([], 0, digests))
        memo = self._memo
        if memo is not None and memo[0] == namespace and memo[1] == digests[0] and memo[2] == end:
            found = memo[3]  # can_admit then admit: one query
        else:
            found = min(end, max(0, int(self.presence.leading_present(digests[:end]))))
            self._memo = (namespace, digests[0], end, found)
        model = self.transfer_model
        if not found or (model is not None and not model.should_load(found, p, start)):
            self._head = (digests[0], start, parent)
            return _new(StoreRun, ([], found, digests))
        if found < len(digests):
            self._head = (digests[found], start + found, digests[found - 1])
        return _new(StoreRun, (digests[:found], found, digests[found:]))

    def plan(
        self,
        request_id: Hashable,
        namespace: Namespace,
        run: list[bytes],
        load_blocks: Sequence[int],
        computed: list[bytes],
        computed_blocks: Sequence[int],
    ) -> None:
        """Record an admission's loads (``run`` into ``load_blocks``) and its write-throughs
        (``computed`` from ``computed_blocks``, once its step ends)."""
        self._memo = None
        if run:
            self.loads += [
                _new(StoreLoad, (request_id, d, b, namespace))
                for d, b in zip(run, load_blocks, strict=True)
            ]
            self.stats.store_loaded_blocks += len(run)
        if computed:
            head = self._head
            if head is not None and head[0] == computed[0]:
                first, parent = head[1], head[2]
            else:  # not where the last query left off: its place in the chain is unknown
                first, parent = 0, None
            writes = []
            for i, (d, b) in enumerate(zip(computed, computed_blocks, strict=True)):
                writes.append(_new(StoreWrite, (d, b, namespace, parent, first + i)))
                parent = d
            self.pending.append((request_id, writes))

    def forget(self, request_ids: Iterable[Hashable]) -> None:
        """Requests taken out before their K/V was written: nothing of theirs is written."""
        gone = set(request_ids)
        self.pending = [(rid, w) for rid, w in self.pending if rid not in gone]

    def end_step(self) -> None:
        """The step's K/V is written: its write-throughs are ready, the next query is fresh."""
        for _, writes in self.pending:
            self.ready += writes
        self.pending = []
        self._memo = None

    def take_loads(self) -> list[StoreLoad]:
        """The loads planned since the last call, which are forgotten."""
        out, self.loads = self.loads, []
        return out

    def take_writes(self) -> list[StoreWrite]:
        """The write-throughs of the ended step (each digest once), which are forgotten."""
        out: list[StoreWrite] = []
        seen: set[bytes] = set()
        for write in self.ready:
            if write.digest not in seen:
                seen.add(write.digest)
                out.append(write)
        self.ready = []
        return out

    def expire(self) -> None:
        """A call that may hand blocks out again: write-throughs not taken by now could read a
        reused block, so they are dropped (and counted)."""
        if self.ready:
            self.stats.store_writes_expired += len(self.ready)
            self.ready = []

    def clear(self) -> None:
        """Every planned load and write gone (a reset)."""
        self.loads, self.pending, self.ready = [], [], []
        self._memo = self._head = None
