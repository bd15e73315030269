"""The runtime's view of the cache: admit, append, fork and release requests over shared blocks.

Every public call validates its input and checks capacity before touching any state, so a
rejected call raises a typed error and changes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from prefixcache.errors import (
    CacheInUseError,
    ConfigError,
    DuplicateRequestError,
    InvalidTokensError,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownRequestError,
)
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventListener
from prefixcache.eviction import Evictor, PolicyKey
from prefixcache.hashing import DIGEST_SIZE, BlockHasher
from prefixcache.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.pool import BlockPool
from prefixcache.radix import Node, RadixIndex
from prefixcache.results import Admission, AppendResult, Copy, Lookup, slots_of
from prefixcache.stats import BlockCounts, CacheStats
from prefixcache.tokens import MAX_TOKEN_ID, TokenIds, as_token_array


class _Seq:
    """A request's private state. It holds the index path from the root down to ``deepest``."""

    __slots__ = ("blocked", "copy_source", "deepest", "num_tokens", "private", "table", "tokens")

    def __init__(
        self, tokens: bytes | bytearray, num_tokens: int, table: list[int], deepest: Node
    ) -> None:
        self.tokens = tokens  # int32 LE token ids (bytes until the first append)
        self.num_tokens = num_tokens
        self.table = table  # block table
        self.private: list[int] = []  # table blocks that are not on the index path
        self.deepest = deepest
        self.blocked = False  # a digest collision stopped committing this sequence
        self.copy_source: Node | None = None  # held until its partial copy has surely run


class CacheManager:
    """Prefix-cached paged block manager for one pool of ``num_blocks`` physical blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        hash_algo: str = "xxh3_128",
        policy: str | PolicyKey = "lru",
        partial_copy: bool = True,
        enable_caching: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, hash_algo)
        self.index = RadixIndex(self.hasher)
        self.pool = BlockPool(num_blocks)
        self.evictor = Evictor(policy)
        self.partial_copy = partial_copy
        self.enable_caching = enable_caching
        self.stats = CacheStats()
        self._clock = clock
        self._tick = 0.0
        self._seqs: dict[Hashable, _Seq] = {}
        self._pins: dict[int, Node] = {}
        self._pin_ids = itertools.count(1)
        self._listeners: list[EventListener] = []

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> Lookup:
        """How much of ``tokens`` is cached, without changing anything (for routing, planning)."""
        arr = as_token_array(tokens)
        root = self.index.roots.get(namespace)
        if root is None or not self.enable_caching:
            return Lookup(0, 0)
        n = self.index.match(root, arr.tobytes(), len(arr) // self.block_size)[2]
        return Lookup(min(n * self.block_size, len(arr) - 1), n)

    def can_admit(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> bool:
        """Whether ``admit`` would succeed now (free plus evictable blocks suffice)."""
        arr = as_token_array(tokens)
        plan = self._plan(arr, arr.tobytes(), namespace)
        return plan[0] <= self._available(plan[1])

    def admit(
        self,
        request_id: Hashable,
        tokens: TokenIds,
        namespace: Namespace = DEFAULT_NAMESPACE,
        *,
        priority: int = 0,
        retention: float | None = None,
    ) -> Admission:
        """Admit a prompt: reuse its longest cached prefix, allocate the rest, index its full
        blocks (so concurrent requests share them at once) and return its block table.

        ``priority`` (with ``retention`` time units, default forever) orders eviction under the
        ``priority`` policy: lower goes first.
        """
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request {request_id!r} is already admitted")
        arr = as_token_array(tokens)
        buf = arr.tobytes()
        need, held_cached, node, j, n, digest, shared, cow = self._plan(arr, buf, namespace)
        if need > self._available(held_cached):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} new blocks but only "
                f"{self._available(held_cached)} are free or evictable; release requests first"
            )
        # ---- from here on nothing can fail ----
        p, t = self.block_size, len(arr)
        now = self._now()
        if n == 0:
            node = self.index.root(namespace)
        elif j < len(node.blocks):
            node = self.index.split(node, j)
        self.index.hold(node, now, hit=True)
        candidate = None
        if self.partial_copy and not cow and n * p < t - 1 and self.enable_caching:
            limit = min(p, t - 1 - n * p)
            candidate = self.index.partial_candidate(node, buf, n, limit)
        fresh = self._take(need)
        table = self.index.path_blocks(node) if n else []
        src = table[-1] if cow else -1
        del table[shared:]
        table += fresh
        seq = _Seq(buf, t, table, node)
        seq.private = fresh  # a new list from the pool: the sequence owns it
        copies: list[Copy] = []
        cached_len = shared * p
        if cow:  # every prompt token is cached: recompute only the last one, in a private copy
            copies.append(Copy(src, fresh[0], p - 1))
            cached_len = t - 1
            self.stats.cow_copies += 1
        elif candidate is not None:
            cand, m = candidate
            # our own allocation may have evicted it; eviction trims from the tail, so its first
            # block is gone only with the whole node, which then has no parent
            if cand.parent is not None:
                copies.append(Copy(cand.blocks[0], fresh[0], m))
                cached_len += m
                self.index.hold(cand, now)
                seq.copy_source = cand
                self.stats.partial_copies += 1
                self.stats.partial_copy_tokens += m
        if self.enable_caching:
            self._commit(seq, arr, buf, t // p, digest if n else None, now)
        if priority:
            self._set_priority(seq.deepest, priority, retention, now)
        self._seqs[request_id] = seq
        st = self.stats
        st.requests += 1
        st.lookup_tokens += t
        st.hit_tokens += cached_len
        st.lookup_blocks += t // p
        st.hit_blocks += n
        st.zero_hit_requests += cached_len == 0
        return Admission(cached_len, list(table), copies, t, p)

    def _plan(self, arr: np.ndarray, buf: bytes, namespace: Namespace) -> tuple[Any, ...]:
        """Match and size an admission without changing anything.

        Returns (new blocks needed, matched blocks that are now unreferenced (or an upper bound
        on them when capacity is plentiful), match node, j, n, digest, blocks shared in the
        table, whether the last block is copied on write).
        """
        p, t = self.block_size, len(arr)
        num_logical = -(-t // p)
        if num_logical > self.num_blocks:
            raise RequestTooLargeError(
                f"{t} tokens need {num_logical} blocks of {p}, more than the pool's "
                f"{self.num_blocks}; raise num_blocks or split the request"
            )
        root = self.index.roots.get(namespace)
        if root is None or not self.enable_caching:
            return num_logical, 0, root, 0, 0, b"", 0, False
        node, j, n, digest = self.index.match(root, buf, t // p)
        cow = n > 0 and n * p == t
        shared = n - 1 if cow else n
        need = num_logical - shared
        if need <= self._available(n):  # fits even if every matched block were unheld now
            return need, n, node, j, n, digest, shared, cow
        held_cached = 0
        cur, count = node, j
        while cur.parent is not None:  # matched blocks nobody holds yet: we will hold them
            if cur.ref == 0:
                held_cached += count
            cur = cur.parent
            count = len(cur.blocks)
        return need, held_cached, node, j, n, digest, shared, cow

    def _available(self, held_cached: int) -> int:
        cached = self.index.num_blocks - self.index.active_blocks
        return self.pool.num_free + cached - held_cached

    # ---- decode ---------------------------------------------------------------------------
    def can_append(self, request_id: Hashable, num_tokens: int = 1) -> bool:
        seq = self._seq(request_id)
        return self._append_need(seq, num_tokens) <= self._available(0)

    def append(self, request_id: Hashable, tokens: TokenIds | int) -> AppendResult:
        """Append generated tokens (one int, or any token container); allocates blocks as needed
        and copies a shared partial last block before writing into it. Newly filled blocks enter
        the index."""
        seq = self._seq(request_id)
        if type(tokens) is int:  # the decode fast path: no array round trip for one token
            if not 0 <= tokens <= MAX_TOKEN_ID:
                raise InvalidTokensError(f"token ids must be in [0, 2**31), got {tokens}")
            data, k = tokens.to_bytes(4, "little"), 1
        else:
            data = as_token_array(tokens).tobytes()
            k = len(data) // 4
        need = self._append_need(seq, k)
        if need > self._available(0):
            raise OutOfBlocksError(
                f"appending {k} tokens to {request_id!r} needs {need} blocks but only "
                f"{self._available(0)} are free or evictable"
            )
        p, t0 = self.block_size, seq.num_tokens
        t1 = t0 + k
        if seq.copy_source is not None:  # the prefill that ran the partial copy is done
            self._unhold(seq.copy_source)
            seq.copy_source = None
        fresh = self._take(need)
        copies: list[Copy] = []
        if t0 % p and self.pool.refcount[seq.table[-1]] > 1:  # shared partial block: copy first
            old, dst = seq.table[-1], fresh.pop(0)
            copies.append(Copy(old, dst, t0 % p))
            self.pool.drop([old])
            seq.private[seq.private.index(old)] = dst
            seq.table[-1] = dst
            self.stats.cow_copies += 1
        seq.table.extend(fresh)
        seq.private.extend(fresh)
        if type(seq.tokens) is bytes:  # first append: the prompt's buffer becomes growable
            seq.tokens = bytearray(seq.tokens)
        seq.tokens += data
        seq.num_tokens = t1
        self.stats.appended_tokens += k
        if self.enable_caching and t1 // p > t0 // p:
            full = np.frombuffer(seq.tokens, dtype="<i4")
            self._commit(seq, full, seq.tokens, t1 // p, None, self._now())
            del full  # release the buffer export so the sequence can grow again
        if k == 1:
            slots = np.array([seq.table[t0 // p] * p + t0 % p], dtype=np.int64)
        else:
            slots = slots_of(seq.table, p, t0, t1)
        return AppendResult(slots, copies)

    def _append_need(self, seq: _Seq, k: int) -> int:
        p, t0 = self.block_size, seq.num_tokens
        need = -(-(t0 + k) // p) - len(seq.table)
        if t0 % p and self.pool.refcount[seq.table[-1]] > 1:
            need += 1
        return need

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks, the partial last
        one too (parallel sampling, beam search). Writes copy on demand."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise DuplicateRequestError(f"request {child_id!r} is already admitted")
        child = _Seq(
            bytearray(parent.tokens), parent.num_tokens, list(parent.table), parent.deepest
        )
        child.private = list(parent.private)
        child.blocked = parent.blocked
        self.pool.share(child.private)
        self.index.hold(child.deepest, self._now())
        self._seqs[child_id] = child
        self.stats.forks += 1

    def release(self, request_id: Hashable) -> None:
        """Finish a request. Its indexed blocks stay cached (evictable); private ones are freed."""
        seq = self._seq(request_id)
        del self._seqs[request_id]
        if seq.copy_source is not None:
            self._unhold(seq.copy_source)
        self._unhold(seq.deepest)
        self.pool.drop(seq.private)

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks now (policy order); returns how many."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        count = min(num_blocks, self.index.num_blocks - self.index.active_blocks)
        if count:
            self._evict(count)
        return count

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, tokens: TokenIds, namespace: Namespace = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """Keep the cached prefix of ``tokens`` from eviction (system prompts, attention sinks).

        Returns ``(handle, pinned_tokens)``; only what is cached now is pinned.
        """
        arr = as_token_array(tokens)
        root = self.index.roots.get(namespace)
        if root is None:
            return 0, 0
        node, j, n, _ = self.index.match(root, arr.tobytes(), len(arr) // self.block_size)
        if n == 0:
            return 0, 0
        if j < len(node.blocks):
            node = self.index.split(node, j)
        self.index.hold(node, self._now())
        handle = next(self._pin_ids)
        self._pins[handle] = node
        return handle, n * self.block_size

    def unpin(self, handle: int) -> None:
        if handle == 0:
            return
        node = self._pins.pop(handle, None)
        if node is None:
            raise UnknownRequestError(f"pin handle {handle!r} is not active")
        self._unhold(node)

    # ---- views ----------------------------------------------------------------------------
    def block_table(self, request_id: Hashable) -> list[int]:
        return list(self._seq(request_id).table)

    def num_tokens(self, request_id: Hashable) -> int:
        return self._seq(request_id).num_tokens

    def token_ids(self, request_id: Hashable) -> np.ndarray:
        return np.frombuffer(bytes(self._seq(request_id).tokens), dtype="<i4")

    def block_tables(
        self, request_ids: Iterable[Hashable], device: Any = "cpu", pad: int = -1
    ) -> Any:
        """Block tables as an int32 torch tensor ``[batch, max_blocks]`` on ``device``."""
        import torch

        tables = [self._seq(r).table for r in request_ids]
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        width = int(lens.max()) if len(tables) else 0
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
        out = np.full((len(tables), width), pad, dtype=np.int32)
        out[np.arange(width) < lens[:, None]] = flat  # row-major fill of each row's prefix
        return torch.from_numpy(out).to(device)

    @property
    def requests(self) -> list[Hashable]:
        return list(self._seqs)

    def block_counts(self) -> BlockCounts:
        active = self.index.active_blocks + self.pool.num_private
        cached = self.index.num_blocks - self.index.active_blocks
        return BlockCounts(self.pool.num_free, active, cached)

    def add_listener(self, listener: EventListener) -> None:
        """Call ``listener`` with BlockStored / BlockRemoved / AllBlocksCleared events."""
        self._listeners.append(listener)

    def reset(self, *, force: bool = False) -> None:
        """Drop every cached block. Refuses while requests or pins hold blocks unless forced;
        a forced reset also drops every request and pin."""
        in_use = self.block_counts().active
        if in_use and not force:
            raise CacheInUseError(
                f"{in_use} blocks are in use by {len(self._seqs)} requests and {len(self._pins)}"
                " pins; release them first or pass force=True"
            )
        self._seqs.clear()
        self._pins.clear()
        self.index = RadixIndex(self.hasher)
        self.pool.reset()
        self.evictor.clear()
        for listener in self._listeners:
            listener(AllBlocksCleared())

    # ---- internals ------------------------------------------------------------------------
    def _seq(self, request_id: Hashable) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"request {request_id!r} is not admitted (or was released)")
        return seq

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        self._tick += 1.0
        return self._tick

    @staticmethod
    def _set_priority(node: Node, priority: int, retention: float | None, now: float) -> None:
        """Apply a request's retention priority to its path (the higher live priority wins)."""
        until = float("inf") if retention is None else now + retention
        while node.parent is not None:
            if node.retain_until <= now or priority >= node.priority:
                node.priority, node.retain_until = priority, until
            node = node.parent

    def _unhold(self, node: Node) -> None:
        now = self._now()
        leaf = self.index.unhold(node, now)
        if leaf is not None:
            self.evictor.push(leaf, now)
            self.evictor.compact(self.index.num_nodes)

    def _take(self, k: int) -> list[int]:
        """``k`` private blocks, evicting exactly the deficit (capacity was checked)."""
        deficit = k - self.pool.num_free
        if deficit > 0:
            self._evict(deficit)
        return self.pool.take(k)

    def _evict(self, count: int) -> None:
        now = self._now()
        while count > 0:
            node = self.evictor.pop(now)
            assert node is not None, "capacity check admitted more than is evictable"
            k = min(count, len(node.blocks))
            parent = node.parent
            ids, digests = self.index.evict_tail(node, k)
            self.pool.give_back(ids)
            self.stats.evicted_blocks += k
            count -= k
            if self._listeners:
                hashes = [digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)]
                self._emit(BlockRemoved(hashes, self.index.namespace_of(parent or node)))
            if node.blocks:
                self.evictor.push(node, now)
            elif (
                parent is not None and parent.parent is not None and self.evictor._evictable(parent)
            ):
                self.evictor.push(parent, now)

    def _commit(
        self,
        seq: _Seq,
        tokens: np.ndarray,
        buf: bytes | bytearray,
        upto: int,
        digest: bytes | None,
        now: float,
    ) -> None:
        """Enter the sequence's full blocks up to ``upto`` into the index, in order.

        A block already cached by another sequence stays private here (a duplicate) and the
        sequence's path moves onto the cached one; a digest collision stops committing.
        """
        parent = seq.deepest
        start = parent.end if parent.parent is not None else 0
        if seq.blocked or upto <= start:
            return
        index = self.index
        if digest is None:
            digest = parent.last_digest()
        digests = self.hasher.hash_blocks(tokens, digest, start, upto)
        i = start
        while i < upto:
            child = parent.children.get(digests[i - start]) if parent.children else None
            if child is None:
                break
            k = min(len(child.blocks), upto - i)
            m = index._common_blocks(child, 0, buf, i, k)
            if m == 0:
                seq.blocked = True
                seq.deepest = parent
                return
            if m < len(child.blocks):
                child = index.split(child, m)
            index.hold_one(child, now)
            parent, i = child, i + m
        if i < upto:
            bb = index.block_bytes
            ids = seq.table[i:upto]
            run = buf[i * bb : upto * bb]
            node = index.add(parent, digests[i - start :], run, ids, now)
            self.pool.to_index(ids)
            private = seq.private
            if private[: len(ids)] == ids:  # the usual case: the oldest private blocks
                del private[: len(ids)]
            else:
                gone = set(ids)
                seq.private = [b for b in private if b not in gone]
            self.stats.stored_blocks += len(ids)
            if self._listeners:
                prev = digests[i - start - 1] if i > start else (digest if i > 0 else None)
                self._emit(
                    BlockStored(
                        digests[i - start :],
                        prev,
                        np.frombuffer(run, dtype="<i4").tolist(),
                        self.block_size,
                        index.namespace_of(node),
                    )
                )
            parent = node
        seq.deepest = parent

    def _emit(self, event: Any) -> None:
        for listener in self._listeners:
            listener(event)

    # ---- verification ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant of DESIGN.md that the bookkeeping can see. O(cache size)."""
        from prefixcache.integrity import check_manager

        check_manager(self)
