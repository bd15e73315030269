"""Requests' block tables: setting up an admitted prompt's from its plan, growing them as
tokens are appended (copying a shared partial last block before it is written), and sharing
them with a fork; and the retention claims a request puts on its blocks.

Capacity is checked before anything changes (by the caller for an admission), so nothing
here fails half-way.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import Node
from prefixcache.blocks.tokens import checked_token_bytes
from prefixcache.errors import OutOfBlocksError
from prefixcache.manager.admission_planning import AdmissionPlan
from prefixcache.manager.argument_checks import live_request
from prefixcache.manager.block_indexing import BlockIndexer
from prefixcache.manager.block_supply import BlockSupply
from prefixcache.manager.results import Admission, AppendResult, Copy, slots_of
from prefixcache.manager.state import CacheState, RequestState
from prefixcache.manager.step_ledger import StepLedger
from prefixcache.manager.tenant_shares import ShareEvictor

_NO_SLOTS = np.empty(0, dtype=np.int64)  # what an append that maps no slots returns
_NO_SLOTS.flags.writeable = False
_new = tuple.__new__  # a NamedTuple from a tuple in C (its generated __new__ is a Python call)


class RequestBlocks:
    """Gives requests their blocks: the cached prefix they share, the new ones they write."""

    __slots__ = ("indexer", "ledger", "state", "supply")

    def __init__(
        self, state: CacheState, supply: BlockSupply, indexer: BlockIndexer, ledger: StepLedger
    ) -> None:
        self.state = state  # its index is read anew (a reset replaces it)
        self.supply = supply
        self.indexer = indexer
        self.ledger = ledger

    def admit(
        self,
        request_id: Hashable,
        namespace: Namespace,
        buf: bytes,
        plan: AdmissionPlan,
        priority: int,
        retention: float | None,
        digests: list[bytes] | None = None,
    ) -> Admission:
        """Carry out a plan (its capacity checked): hold the matched prefix, take the new
        blocks, plan the copies and loads, index the prompt's full blocks (``digests``: theirs,
        when the caller has them) and register the request."""
        state = self.state
        index, p, t = state.index, state.block_size, len(buf) // 4
        now = state.now()
        node: Node | None = None
        digest = None
        matched = 0
        table: list[int] = []
        match = plan.match
        if match is not None:
            matched = match.n
            if matched:
                node, digest, j = match.node, match.digest, match.j
                if j < len(node.blocks):
                    node = index.split(node, j)
                table = index.hold_table(node, now)  # held nodes: eviction leaves the table be
        host_run = plan.host_run
        holders: list[tuple[int, Node]] | None = None
        offload = state.offload
        if host_run:  # off the host tier before any offload of ours can evict them
            assert offload is not None and match is not None
            host_slots, holders = offload.unload(match.node, host_run, namespace)
        partial = plan.partial
        if partial is not None:  # the copy source must survive our own eviction (see planning)
            source = partial.node
            if len(source.blocks) > 1:  # hold the copied block alone, not the whole run
                source = index.split(source, 1)
            index.hold(source, now)
        fresh = self.supply.take(plan.need, owned=False, tenant=namespace.salt)  # owned: below
        if host_run:
            assert offload is not None
            offload.plan_loads(host_slots, fresh, stepped=state.stepped)
        cow = plan.cow
        cow_source = table[-1] if cow else -1
        del table[plan.shared :]
        table += fresh
        seq = RequestState(request_id, namespace, buf, t, table, node)
        seq.private = fresh  # a new list from the pool: the request owns it
        st = state.stats
        copies: list[Copy] = []
        partial_tokens = 0
        if cow:  # every prompt token is cached: recompute only the last one, in a copy
            if p > 1:  # one-token blocks: nothing to copy, the block is recomputed
                copies.append(Copy(cow_source, fresh[0], p - 1))
                st.cow_copies += 1
        elif partial is not None:
            partial_tokens = partial.m  # its source is held since before our allocation
            copies.append(Copy(source.blocks[0], fresh[0], partial_tokens))
            seq.copy_source = source
            st.partial_copies += 1
            st.partial_copy_tokens += partial_tokens
        seq.unconfirmed = True
        stored = plan.store_run
        computed = plan.computed
        if state.enable_caching:
            known = host_run
            if computed is not None:  # a store: every digest past the match is known
                known = host_run + stored + computed
            elif digests is not None and not host_run:
                known = digests[matched:]
            self.indexer.index_blocks(
                seq,
                buf,
                t // p,
                digest,
                now,
                owned=False,
                known=known,
                holders=holders,
                loaded=len(host_run),
            )
            if computed is not None:
                assert state.store is not None
                first = matched + len(host_run)  # the first block loaded from the store
                middle = first + len(stored)
                table = seq.table
                end = middle + len(computed)
                state.store.plan(
                    request_id, namespace, stored, table[first:middle], computed, table[middle:end]
                )
        state.pool.own(seq.private)  # usually just the partial last block
        if priority or retention is not None or state.claims_all:
            seq.claim = (priority, math.inf if retention is None else now + retention)
            add_claim(seq.deepest, seq.claim, now)
        state.seqs[request_id] = seq
        cached_len, loaded = plan.cached_len, len(host_run)
        st.requests += 1
        st.lookup_tokens += t
        st.hit_tokens += cached_len
        st.lookup_blocks += t // p
        st.hit_blocks += matched + loaded + len(stored)
        st.zero_hit_requests += cached_len == 0
        if plan.host_found:
            st.host_hit_blocks += plan.host_found
            st.loaded_blocks += loaded
        if plan.store_found:
            st.store_hit_blocks += plan.store_found
        return _new(
            Admission,
            (cached_len, list(table), copies, t, p, matched, partial_tokens, cow, loaded),
        )

    def append_need(self, seq: RequestState, k: int) -> int:
        """New blocks an append of ``k`` tokens to ``seq`` takes (a shared partial last block
        is copied first)."""
        p, t0 = self.state.block_size, seq.num_tokens
        need = -(-(t0 + k) // p) - len(seq.table)
        if k and t0 % p and self.state.pool.refcount[seq.table[-1]] > 1:
            need += 1
        return need

    def append(self, seq: RequestState, data: bytes, k: int, map_slots: bool) -> AppendResult:
        """Append ``k`` tokens (``data``: int32 LE) to ``seq``, taking the blocks it needs
        (OutOfBlocksError, changing nothing, when they are not there); newly filled blocks
        enter the index. ``map_slots``: return the tokens' slots (else an empty array)."""
        state = self.state
        pool, p, t0 = state.pool, state.block_size, seq.num_tokens
        t1 = t0 + k
        need = -(-t1 // p) - len(seq.table)  # as append_need, inline on the decode path
        shared_last = bool(k and t0 % p) and pool.refcount[seq.table[-1]] > 1
        if shared_last:
            need += 1
        if need > 0:  # none needed: nothing to check, take or evict (the usual block filling)
            available = self.supply.available(0)
            if need > available:
                raise OutOfBlocksError(
                    f"appending {k} tokens to {seq.request_id!r} needs {need} blocks but only "
                    f"{available} are free or evictable",
                    needed=need,
                    available=available,
                )
        if seq.copy_source is not None:  # the prefill that ran the partial copy is planned
            self.ledger.let_go_copy_source(seq)
        copies: list[Copy] = []
        if need > 0 or isinstance(state.evictor, ShareEvictor):  # a capped tenant evicts first
            fresh = self.supply.take(need, tenant=seq.namespace.salt)
            if shared_last:  # shared partial block: copy first
                old, dst = seq.table[-1], fresh.pop(0)
                copies.append(Copy(old, dst, t0 % p))
                self.ledger.let_go_copied_block(old)
                seq.private[seq.private.index(old)] = dst
                seq.table[-1] = dst
                state.stats.cow_copies += 1
            seq.table.extend(fresh)
            seq.private.extend(fresh)
        if type(seq.tokens) is bytes:  # first append: the prompt's buffer becomes growable
            seq.tokens = bytearray(seq.tokens)
        seq.tokens += data
        seq.num_tokens = t1
        seq.unconfirmed = True
        state.stats.appended_tokens += k
        if state.enable_caching and t1 // p > t0 // p:
            now = state.now()
            self.indexer.index_blocks(seq, seq.tokens, t1 // p, None, now)
            if seq.claim is not None:  # the blocks it decoded carry its claim too
                add_claim(seq.deepest, seq.claim, now)
        if not map_slots:
            return _new(AppendResult, (_NO_SLOTS, copies))
        return _new(AppendResult, (slots_of(seq.table, p, t0, t1), copies))

    def fork(self, parent: RequestState, child_id: Hashable) -> None:
        """Start ``child_id`` sharing every block of ``parent``, the partial last one too."""
        child = RequestState(
            child_id,
            parent.namespace,
            bytearray(parent.tokens),
            parent.num_tokens,
            list(parent.table),
            parent.deepest,
        )
        child.private = list(parent.private)
        child.blocked = parent.blocked
        child.claim = parent.claim
        state = self.state
        state.pool.share(child.private)
        state.index.hold(child.deepest, state.now())
        self.ledger.add_fork(parent, child)
        state.seqs[child_id] = child
        state.stats.forks += 1


class TokenAppender:
    """``CacheManager.append(request_id, tokens, map_slots=False)`` for a decode loop that holds
    its tokens as int32 LE bytes (``CacheManager.appender``): the same checks, blocks, copies,
    index entries and typed errors, with no Python frame between the loop and the block tables.
    Serves its manager for its whole life, across ``reset``."""

    __slots__ = ("_blocks", "_state")

    def __init__(self, blocks: RequestBlocks) -> None:
        self._blocks = blocks
        self._state = blocks.state

    def __call__(self, request_id: Hashable, data: object) -> AppendResult:
        """Append the tokens ``data`` (int32 LE ``bytes``) to ``request_id``."""
        state = self._state
        seq = live_request(state.seqs, request_id)
        buf = checked_token_bytes(data)  # typed here: a compiled signature raises TypeError
        if state.store is not None:
            state.store.expire()  # as ``expire_store_writes``, inline on the decode path
        return self._blocks.append(seq, buf, len(buf) // 4, False)


# ---- retention claims: the priority a request gives its blocks under the ``priority``
# eviction policy, and how long that priority holds

Claim = tuple[int, float]  # (priority, retained until): lower priority is evicted first


def add_claim(node: Node | None, claim: Claim, now: float) -> None:
    """Add a request's retention claim to its path, from ``node`` up to the root.

    A node keeps the claims that can still decide: the highest live priority wins, and a lower
    one that outlives it takes over when its retention ends. A node that keeps the claim already
    has it on its whole path (it was added to the path, or dropped where a claim that outlasts
    it wins): the walk stops there, so a decoding request adds it to its new blocks only."""
    while node is not None and node.parent is not None:
        if (node.priority, node.retain_until) == claim or claim in node.later:
            return
        claims = [(node.priority, node.retain_until), *node.later, claim]
        claims.sort(key=_strongest_first)
        kept: list[Claim] = []
        outlasted = now  # a claim counts while no higher one outlasts it
        for priority, until in claims:
            if until > outlasted:
                kept.append((priority, until))
                outlasted = until
        node.priority, node.retain_until = kept[0] if kept else (0, 0.0)
        node.later = tuple(kept[1:])
        node = node.parent


def _strongest_first(claim: Claim) -> tuple[int, float]:
    priority, until = claim
    return -priority, -until
