"""Blocks in shared K/V stores, as the replicas attached to them announce them.

A runtime that writes its computed blocks through to a shared store (prefixcache's
``KVStoreConnector``) announces them with the medium ``STORE``, and the blocks its writes
evicted from the store, or that it found corrupt and removed, with a ``STORE`` removal. Such a
block is in the store, not on the replica: any replica attached to the same store can load it.
So a ``STORE`` event of a replica configured with ``kv_store: NAME`` is applied to the index
under ``store:NAME``, a holder of its own, which the router reads for every replica attached to
that store (router.py). A replica without ``kv_store`` keeps ``STORE`` as one more medium of
its own blocks.

The announcements carry no token ids (as vLLM's offload connectors' do not): a stored block is
one the announcing replica holds already, found through its map of engine hashes; each store
keeps its own map (engine hash -> digest), shared by its replicas, so a removal announced by
another replica than the one that stored the block still finds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.fleet.events.replica_stream import ReplicaStream
from prefixcache.fleet.events.wire import BlockHash
from prefixcache.fleet.index.interface import FleetIndex
from prefixcache.medium import CPU


def store_holder(store: str) -> str:
    """The index's name for what a shared store holds."""
    return f"store:{store}"


class SharedStoreBlocks:
    """Applies ``STORE`` events of replicas attached to a store to the store's holder."""

    def __init__(self, index: FleetIndex, max_blocks_per_store: int) -> None:
        self.index = index
        self.max_blocks = max_blocks_per_store
        self.maps: dict[str, dict[BlockHash, bytes]] = {}  # store -> engine hash -> digest

    def stored(self, rep: ReplicaStream, store: str, block_hashes: Sequence[BlockHash]) -> None:
        """``rep`` wrote these blocks (ones it holds) to ``store``."""
        known = self.maps.setdefault(store, {})
        digests = []
        for h in block_hashes:
            entry = rep.blocks.get(h)
            digest = entry[0] if entry is not None else known.get(h)
            if digest is None or (h not in known and len(known) >= self.max_blocks):
                rep.counts.skipped += 1  # not a block the replica holds, or the map is full
                continue
            known[h] = digest
            digests.append(digest)
        if digests:
            self.index.store(store_holder(store), digests, CPU)
            rep.counts.blocks_stored += len(digests)

    def removed(self, rep: ReplicaStream, store: str, block_hashes: Sequence[BlockHash]) -> None:
        """These blocks left ``store`` (evicted by a write of ``rep``'s, or refused)."""
        known = self.maps.get(store)
        if not known:
            return
        digests = [d for d in (known.pop(h, None) for h in block_hashes) if d is not None]
        if digests:
            self.index.remove(store_holder(store), digests, None)
            rep.counts.blocks_removed += len(digests)

    def clear(self, store: str) -> None:
        """The store was emptied (restarted): it holds nothing."""
        self.maps.pop(store, None)
        self.index.clear(store_holder(store))
