"""Where a request's new blocks come from: the pool's free blocks first, then cached blocks
evicted in policy order (offered to the host tier when there is one)."""

from __future__ import annotations

from prefixcache.blocks.hashing import DIGEST_SIZE, split_digests
from prefixcache.blocks.radix import Node
from prefixcache.manager.block_events import BlockRemoved
from prefixcache.manager.state import CacheState, RequestState


class BlockSupply:
    """Hands out GPU blocks, evicting exactly the deficit, and takes back what requests let go
    of (an index path nobody holds any more becomes evictable)."""

    __slots__ = ("events", "evictor", "index", "now", "offload", "pool", "stats")

    def __init__(self, state: CacheState) -> None:
        self.index = state.index
        self.pool = state.pool
        self.evictor = state.evictor
        self.stats = state.stats
        self.events = state.listeners
        self.offload = state.offload  # None: evicted blocks leave the cache
        self.now = state.now

    def evictable(self) -> int:
        """Cached blocks nobody holds."""
        return self.index.num_blocks - self.index.active_blocks

    def available(self, held_cached: int) -> int:
        """Blocks an allocation can get now: the free ones and the evictable ones, less
        ``held_cached`` evictable blocks that the caller is about to hold."""
        index = self.index
        return self.pool.num_free + index.num_blocks - index.active_blocks - held_cached

    def take(self, k: int, *, owned: bool = True) -> list[int]:
        """``k`` private blocks, evicting exactly the deficit (capacity was checked). Not
        ``owned``: no refcounts yet (see ``BlockPool.take_unowned``)."""
        deficit = k - self.pool.num_free
        if deficit > 0:
            self.evict(deficit)
        return self.pool.take(k) if owned else self.pool.take_unowned(k)

    def evict(self, count: int) -> None:
        """Evict ``count`` cached blocks in policy order, each node from its tail (that many
        are evictable: checked by the caller)."""
        now = self.now()
        index, evictor, events, offload = self.index, self.evictor, self.events, self.offload
        if offload is None and not events.callbacks:  # nobody needs the digests: drop the tails
            give_back = self.pool.give_back
            evicted = count
            while count > 0:
                node = evictor.pop(now)
                assert node is not None, "capacity check admitted more than is evictable"
                k = len(node.blocks)
                if count < k:
                    k = count
                parent = node.parent
                give_back(index.trim_tail(node, k))
                count -= k
                if node.blocks:
                    evictor.push(node, now)
                elif parent is not None and parent.parent is not None and evictor.evictable(parent):
                    evictor.push(parent, now)
            self.stats.evicted_blocks += evicted
            return
        while count > 0:
            node = evictor.pop(now)
            assert node is not None, "capacity check admitted more than is evictable"
            k = min(count, len(node.blocks))
            parent = node.parent
            if events.callbacks:
                namespace = node.namespace
                assert namespace is not None
                events.emit(
                    BlockRemoved(split_digests(bytes(node.digests[-k * DIGEST_SIZE :])), namespace)
                )
            if offload is not None:  # the blocks move to host (as many as it has room for)
                ids = offload.offload(node, k)
            else:
                ids = index.trim_tail(node, k)
            self.pool.give_back(ids)
            self.stats.evicted_blocks += k
            count -= k
            if node.blocks and not node.on_host:
                evictor.push(node, now)
            elif parent is not None and parent.parent is not None and evictor.evictable(parent):
                evictor.push(parent, now)

    def unhold(self, node: Node | None) -> None:
        """Drop one hold on the path from the root to ``node``; a leaf nobody holds any more
        becomes evictable."""
        now = self.now()
        leaf = self.index.unhold(node, now)
        if leaf is not None:
            self.evictor.push(leaf, now)
            self.evictor.compact(self.index.num_nodes)

    def release_request(self, seq: RequestState) -> None:
        """Give back everything a request holds: its copy source, its index path and its
        private blocks (it has left the live requests already)."""
        if seq.copy_source is not None:
            self.unhold(seq.copy_source)
            seq.copy_source = None
        self.unhold(seq.deepest)
        self.pool.drop(seq.private)
