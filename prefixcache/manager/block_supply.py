"""Where a request's new blocks come from: the pool's free blocks first, then cached blocks
evicted in policy order (offered to the host tier when there is one). With tenant shares
(tenant_shares.py) the order keeps guarantees, and a tenant at its cap evicts its own blocks
before it grows."""

from __future__ import annotations

from prefixcache.blocks.hashing import DIGEST_SIZE, split_digests
from prefixcache.blocks.radix import Node
from prefixcache.manager.block_events import BlockRemoved
from prefixcache.manager.state import CacheState, RequestState
from prefixcache.manager.tenant_shares import ShareEvictor


class BlockSupply:
    """Hands out GPU blocks, evicting exactly the deficit, and takes back what requests let go
    of (an index path nobody holds any more becomes evictable)."""

    __slots__ = ("state",)

    def __init__(self, state: CacheState) -> None:
        self.state = state  # its index, eviction order and tenant counters are read anew

    def evictable(self) -> int:
        """Cached blocks nobody holds."""
        index = self.state.index
        return index.num_blocks - index.active_blocks

    def available(self, held_cached: int) -> int:
        """Blocks an allocation can get now: the free ones and the evictable ones, less
        ``held_cached`` evictable blocks that the caller is about to hold."""
        state = self.state
        index = state.index
        return state.pool.num_free + index.num_blocks - index.active_blocks - held_cached

    def take(self, k: int, *, owned: bool = True, tenant: str | None = None) -> list[int]:
        """``k`` private blocks for a request of ``tenant``, evicting exactly the deficit
        (capacity was checked); a tenant at its cap first evicts its own. Not ``owned``: no
        refcounts yet (see ``BlockPool.take_unowned``)."""
        pool, evictor = self.state.pool, self.state.evictor
        if tenant is not None and isinstance(evictor, ShareEvictor):
            self._keep_cap(evictor, tenant, k)
        deficit = k - pool.num_free
        if deficit > 0:
            self.evict(deficit, tenant)
        return pool.take(k) if owned else pool.take_unowned(k)

    def evict(self, count: int, cause: str | None = None, *, asked: bool = False) -> None:
        """Evict ``count`` cached blocks in policy order, each node from its tail (that many
        are evictable: checked by the caller), for an allocation of tenant ``cause``
        (``asked``: for the runtime's own ``evict`` call, no tenant's)."""
        state = self.state
        now = state.now()
        evictor = state.evictor
        if isinstance(evictor, ShareEvictor):
            self._evict_shared(evictor, count, cause, now, asked)
            return
        index = state.index
        if state.offload is None and not state.listeners.callbacks:  # nobody needs the digests
            give_back = state.pool.give_back
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
            state.stats.evicted_blocks += evicted
            return
        while count > 0:  # the digests go to listeners, or the blocks to host
            node = evictor.pop(now)
            assert node is not None, "capacity check admitted more than is evictable"
            k = min(count, len(node.blocks))
            self._evict_tail(node, k, cause, now, capped=False, breaks=False)
            count -= k

    def _evict_shared(
        self, shares: ShareEvictor, count: int, cause: str | None, now: float, asked: bool
    ) -> None:
        """``evict`` with tenant shares: guarantees kept while anything else can go."""
        while count > 0:
            victim = shares.pop_victim(now)
            assert victim is not None, "capacity check admitted more than is evictable"
            node = victim.node
            k = min(count, len(node.blocks), victim.limit)
            if asked:  # nobody's allocation: not another tenant's doing
                namespace = node.namespace
                cause = namespace.salt if namespace is not None else None
            self._evict_tail(node, k, cause, now, capped=False, breaks=victim.breaks_guarantee)
            count -= k

    def _keep_cap(self, shares: ShareEvictor, tenant: str, k: int) -> None:
        """Before ``tenant`` grows by ``k`` blocks: past its cap, it evicts its own oldest
        blocks (those its running requests hold cannot go)."""
        share = shares.shares.get(tenant)
        if share is None or share.cap is None:
            return
        over = shares.counts.get(tenant, 0) + k - share.cap
        now = self.state.now()
        while over > 0:
            node = shares.pop_own(tenant, now)
            if node is None:
                return
            n = min(over, len(node.blocks))
            self._evict_tail(node, n, tenant, now, capped=True, breaks=False)
            over -= n

    def _evict_tail(
        self, node: Node, k: int, cause: str | None, now: float, *, capped: bool, breaks: bool
    ) -> None:
        """Evict the last ``k`` blocks of a leaf popped from the eviction order, for an
        allocation of ``cause``, and file what is left (or its parent) again."""
        state = self.state
        evictor, events, offload = state.evictor, state.listeners, state.offload
        parent = node.parent
        namespace = node.namespace
        assert namespace is not None
        if events.callbacks:
            tail = bytes(node.digests[-k * DIGEST_SIZE :])
            events.emit(BlockRemoved(split_digests(tail), namespace))
        if state.tenants is not None:
            state.tenants.note_eviction(namespace.salt, cause, node, k, capped, breaks)
        if offload is not None:  # the blocks move to host (as many as it has room for)
            ids = offload.offload(node, k)
        else:
            ids = state.index.trim_tail(node, k)
        state.pool.give_back(ids)
        state.stats.evicted_blocks += k
        if node.blocks and not node.on_host:
            evictor.push(node, now)
        elif parent is not None and parent.parent is not None and evictor.evictable(parent):
            evictor.push(parent, now)

    def unhold(self, node: Node | None) -> None:
        """Drop one hold on the path from the root to ``node``; a leaf nobody holds any more
        becomes evictable."""
        state = self.state
        now = state.now()
        leaf = state.index.unhold(node, now)
        if leaf is not None:
            state.evictor.push(leaf, now)
            state.evictor.compact(state.index.num_nodes)

    def release_request(self, seq: RequestState) -> None:
        """Give back everything a request holds: its copy source, its index path and its
        private blocks (it has left the live requests already)."""
        if seq.copy_source is not None:
            self.unhold(seq.copy_source)
            seq.copy_source = None
        self.unhold(seq.deepest)
        self.state.pool.drop(seq.private)
