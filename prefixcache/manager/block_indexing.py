"""Entering a request's full blocks into the radix index, where later requests find them.

A block a request enters is *pending* until its K/V is confirmed written (see step_ledger.py).
A block someone else cached already is not entered twice: the request's copy stays private (a
duplicate) and its path moves onto the cached one. A digest collision stops the request's
indexing for good.
"""

from __future__ import annotations

from prefixcache.blocks.host_tier import HostTier
from prefixcache.blocks.radix import Node
from prefixcache.blocks.tokens import token_list
from prefixcache.manager.block_events import BlockStored
from prefixcache.manager.state import CacheState, RequestState


class BlockIndexer:
    """Indexes requests' full blocks in order, and announces them to the listeners."""

    __slots__ = ("state",)

    def __init__(self, state: CacheState) -> None:
        self.state = state  # its index and tenant counters are read anew

    def index_blocks(
        self,
        seq: RequestState,
        buf: bytes | bytearray,
        upto: int,
        digest: bytes | None,
        now: float,
        *,
        owned: bool = True,
        known: list[bytes] | None = None,
        holders: list[tuple[int, Node]] | None = None,
        loaded: int = 0,
    ) -> None:
        """Enter the request's full blocks up to ``upto`` (``buf``: its int32 LE tokens;
        ``digest``: the digest of its deepest indexed block when the caller knows it) into the
        index, in order; they are pending until confirmed. ``owned``: the blocks carry
        refcounts to drop (not so for a fresh admission's). ``known``: the digests of the
        blocks right after the deepest indexed one, when the caller has them (loaded host
        blocks, and with a store every block), so they are not hashed again; the first
        ``loaded`` come from host, ``holders`` keeping what hung below them there."""
        if seq.blocked:
            return
        parent = seq.deepest
        start = parent.end if parent is not None else 0
        if upto <= start:
            return
        if parent is None:
            parent = self.state.index.root(seq.namespace)
        if digest is None:
            digest = parent.last_digest()
        hasher = self.state.hasher
        if known:
            known = known[: upto - start]
            tail = hasher.hash_buffer(buf, known[-1], start + len(known), upto)
            digests = known + tail if tail else known
        else:
            digests = hasher.hash_buffer(buf, digest, start, upto)
        if parent.children and digests[0] in parent.children:  # blocks someone cached already
            followed = self._follow_cached(seq, parent, digests, buf, now)
            if followed is None:
                return
            parent = followed
        i = parent.end if parent.parent is not None else 0
        if i < upto:
            prev = digests[i - start - 1] if i > start else (digest if i > 0 else None)
            loaded = loaded if holders is not None else 0
            self._store(
                seq, parent, digests[i - start :], buf, i, upto, prev, now, owned, holders, loaded
            )

    def _follow_cached(
        self,
        seq: RequestState,
        parent: Node,
        digests: list[bytes],
        buf: bytes | bytearray,
        now: float,
    ) -> Node | None:
        """Move the request's path over blocks someone else cached already (its own stay
        private duplicates). Returns the last node followed; None when a digest collision
        stopped the request."""
        index = self.state.index
        start = i = parent.end if parent.parent is not None else 0
        upto = start + len(digests)
        while i < upto and parent.children:
            child = parent.children.get(digests[i - start])
            if child is None:
                break
            k = min(len(child.blocks), upto - i)
            m = index.common_blocks(child, buf, i, k)
            if m == 0:
                seq.blocked = True
                return None
            if m < len(child.blocks):
                child = index.split(child, m)
            index.hold(child, now, upto=parent)
            parent, i = child, i + m
            seq.deepest = parent
        return parent

    def _store(
        self,
        seq: RequestState,
        parent: Node,
        digests: list[bytes],
        buf: bytes | bytearray,
        i: int,
        upto: int,
        prev: bytes | None,
        now: float,
        owned: bool,
        holders: list[tuple[int, Node]] | None = None,
        loaded: int = 0,
    ) -> None:
        """Index the request's own blocks ``i .. upto-1`` (``digests``) after ``parent``; they
        are pending. ``prev`` is the digest before them, for the event; ``owned``: they carry
        refcounts to drop; the first ``loaded`` come from host, ``holders`` keeping what hung
        below them there."""
        state = self.state
        index = state.index
        bb = index.block_bytes
        ids = seq.table[i:upto]
        run = buf[i * bb : upto * bb]
        if state.offload is None:
            node = index.add(parent, digests, run, ids, now)
        else:
            node = self._add_over_host(parent, digests, run, ids, now, holders, loaded)
        if owned:
            state.pool.to_index(ids)
        private = seq.private
        if private[: len(ids)] == ids:  # the usual case: the oldest private blocks
            del private[: len(ids)]
        else:
            gone = set(ids)
            seq.private = [b for b in private if b not in gone]
        if seq.pending_start is None:
            seq.pending_start = i
            seq.pending = ids[:]
        else:  # a list by now
            seq.pending.extend(ids)  # type: ignore[union-attr]
        state.stats.stored_blocks += len(ids)
        if state.tenants is not None:  # computed here: those a neighbour evicted count
            state.tenants.note_stored(seq.namespace.salt, digests, loaded)
        events = state.listeners
        if events.callbacks:
            tokens = token_list(run) if events.token_ids else []
            namespace = index.namespace_of(node)
            events.emit(BlockStored(digests, prev, tokens, index.block_size, namespace))
        seq.deepest = node

    def _add_over_host(
        self,
        parent: Node,
        digests: list[bytes],
        run: bytes | bytearray,
        ids: list[int],
        now: float,
        holders: list[tuple[int, Node]] | None,
        loaded: int,
    ) -> Node:
        """``index.add`` with a host tier: some of the blocks were on host, the first
        ``loaded`` ones loaded (``holders`` keep what hung below them) and others computed again
        (their host copies go). What hung below such a block on host hangs below the GPU node
        that ends with it, so the blocks are added in as many nodes as that takes."""
        index, offload = self.state.index, self.state.offload
        assert offload is not None
        node, done, total = parent, 0, len(digests)
        if holders:
            node = self._add_hanging(node, digests, run, ids, now, 0, loaded, holders)
            done = loaded
        while done < total:
            kids = node.host_children
            if kids is None or digests[done] not in kids:
                bb = index.block_bytes
                return index.add(node, digests[done:], run[done * bb :], ids[done:], now)
            end, found = offload.take_recomputed(node, digests, done)
            node = self._add_hanging(node, digests, run, ids, now, done, end, found)
            done = end
        return node

    def _add_hanging(
        self,
        node: Node,
        digests: list[bytes],
        run: bytes | bytearray,
        ids: list[int],
        now: float,
        start: int,
        end: int,
        holders: list[tuple[int, Node]],
    ) -> Node:
        """Add blocks ``start .. end-1`` below ``node``, ending a node after each holder's
        block that still has host children to hang below it. Returns the last node."""
        index, hang = self.state.index, HostTier.hang
        bb = index.block_bytes
        for upto, holder in holders:
            if holder.host_children:  # (host evictions since may have taken them)
                node = index.add(
                    node, digests[start:upto], run[start * bb : upto * bb], ids[start:upto], now
                )
                hang(holder, node)
                start = upto
        if start < end:
            node = index.add(
                node, digests[start:end], run[start * bb : end * bb], ids[start:end], now
            )
        return node
