"""A pooled KV tier shared by every replica of a replay: an LRU of block digests.

The pool models a disaggregated KV store (Mooncake's store, LMCache's remote backend). Under the
``evict`` write policy blocks enter it when they leave a replica's lowest local tier (host
evictions when replicas have a host tier, GPU evictions otherwise; ``PoolFeed``); under
``through`` as soon as a replica computes them (``admission``). A block's 16-byte digest chains
over its whole prefix and its namespace, so a digest names the block together with its chain; a
pooled block is found only as a continuation of a prompt's chain past what the replica's GPU and
host tiers matched. A load copies the block out and leaves it pooled (refreshed). Eviction is
plain LRU over blocks: a pooled block whose parent was evicted stays until it ages out,
unreachable, as in an LRU store that knows nothing of chains.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from prefixcache.medium import CPU


class PoolTier:
    """``capacity`` pooled blocks, least recently stored or loaded evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.stored_blocks = 0  # blocks put into the pool (refreshes not counted)
        self.written_blocks = 0  # blocks sent to the pool (refreshes counted: each is a copy)
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def put(self, digest: bytes) -> None:
        """Store a block sent by a replica (or refresh it), evicting the least recent."""
        blocks = self._blocks
        self.written_blocks += 1
        if digest in blocks:
            blocks.move_to_end(digest)
            return
        blocks[digest] = None
        self.stored_blocks += 1
        if len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evicted_blocks += 1

    def match(self, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` are pooled (a chain continues only while they are)."""
        blocks = self._blocks
        k = 0
        for d in digests:
            if d not in blocks:
                break
            k += 1
        return k

    def touch(self, digests: Sequence[bytes]) -> None:
        """The blocks were loaded: most recent now."""
        for d in digests:
            self._blocks.move_to_end(d)


class PoolFeed:
    """Listens to one replica's cache events and puts the blocks that leave the replica (on
    neither its GPU nor its host tier any more) into the pool, at ``flush()``.

    A removal is only a candidate until the manager call that caused it has finished: a host
    block loaded back, or recomputed, is on the GPU again by then and stays out of the pool.
    """

    def __init__(self, pool: PoolTier) -> None:
        self.pool = pool
        self.gpu: set[bytes] = set()
        self.host: set[bytes] = set()
        self._candidates: list[bytes] = []

    def __call__(self, event: CacheEvent) -> None:
        if isinstance(event, BlockStored):
            (self.host if event.medium == CPU else self.gpu).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            where = self.host if event.medium == CPU else self.gpu
            where.difference_update(event.block_hashes)
            self._candidates += event.block_hashes
        elif isinstance(event, AllBlocksCleared):
            self._candidates += self.gpu
            self._candidates += self.host
            self.gpu.clear()
            self.host.clear()

    def flush(self) -> None:
        """Pool the candidates that left the replica, in the order they left it."""
        if not self._candidates:
            return
        gpu, host, put = self.gpu, self.host, self.pool.put
        for d in self._candidates:
            if d not in gpu and d not in host:
                put(d)
        self._candidates = []
