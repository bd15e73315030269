"""What a fleet replay's router reads of the replicas' caches: their radix trees, while the fleet
index would hold exactly what the trees hold.

The service's index learns a replica's blocks from its KV events; a fleet replay's replicas are
managers in this process, and ``index_feed.ReplicaIndexFeed`` applies their events to a
``MemoryFleetIndex`` as that path would. While every replica is *lean* (GPU blocks only, never more
than the index's cap, every chain under its own digests: no host tier and one version per
adapter), that index's bits are exactly the digests each replica's radix trees hold, so the
answers a route reads (the leading blocks of a chain each replica holds, the blocks each holds)
are read from the trees instead: a walk down a tree, one lookup per node on the path, and nothing
written for the millions of blocks the replicas store and evict meanwhile.

From the first request naming another version of an adapter (its chains are then filed under the
pinned version's digests, which no tree holds), or from the start where a replica is not lean,
the fed index answers: ``file_in_index`` fills it from the trees, then the feeds keep it.
``tests/replay/test_replay_event_loop.py`` compares every fleet figure with the wire path's.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.blocks.hashing import DIGEST_SIZE
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import Node, RadixIndex
from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.fleet.index.mask_loops import store_masks
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.manager.state import ManagerInternals
from prefixcache.medium import GPU

D = DIGEST_SIZE


class ReplicaTrees:
    """The fleet index of a fleet replay, read from the replicas' trees until ``file_in_index``
    (``fed``: the index the feeds keep from then on). ``namespace``: the namespace of the
    digests the next reads are for (the fleet sets it before a route: a chain is found under
    its namespace's root)."""

    def __init__(self, caches: dict[str, ManagerInternals], fed: MemoryFleetIndex) -> None:
        self.caches = caches  # each replica's manager, looked inside (its trees read anew)
        self.fed = fed
        self.filed = False  # the fed index answers
        self.namespace: Namespace | None = None
        self.max_blocks_per_replica = fed.max_blocks_per_replica

    def file_in_index(self) -> dict[str, list[bytes]]:
        """From now on the fed index answers: it takes every block the trees hold, on GPU.
        Returns them, by replica (nothing when it answers already)."""
        held: dict[str, list[bytes]] = {}
        if self.filed:
            return held
        self.filed = True
        for name, inside in self.caches.items():
            digests = held[name] = []
            for node in inside.radix_index.iter_nodes():
                raw = bytes(node.digests)
                digests.extend(raw[i : i + D] for i in range(0, len(raw), D))
            store_masks(self.fed, name, digests, GPU)
        return held

    # ---- what the router and the fleet read ------------------------------------------------
    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each replica holds (all on GPU), by name."""
        if self.filed:
            return self.fed.match(digests)
        if not self.caches:
            return []
        chain = b"".join(digests)
        n = len(digests)
        out = []
        for name, inside in sorted(self.caches.items()):
            k = self._held(inside.radix_index, self.namespace, chain, n)
            out.append(ReplicaMatch(name, k, k))
        return out

    def longest_elsewhere(
        self, digests: Sequence[bytes], replica: str, namespace: Namespace
    ) -> int:
        """The most leading blocks of ``digests`` (of ``namespace``) one replica other than
        ``replica`` holds."""
        if self.filed:
            return self.fed.longest_elsewhere(digests, replica)
        chain = b"".join(digests)
        n = len(digests)
        most = 0
        for name, inside in self.caches.items():
            if name != replica and most < n:
                k = self._held(inside.radix_index, namespace, chain, n)
                if k > most:
                    most = k
        return most

    def num_blocks(self, replica: str) -> int:
        """Blocks ``replica`` holds."""
        if self.filed:
            return self.fed.num_blocks(replica)
        inside = self.caches.get(replica)
        return inside.radix_index.num_blocks if inside is not None else 0

    def num_blocks_many(self, replicas: Sequence[str], medium: str | None = None) -> dict[str, int]:
        """Blocks each of ``replicas`` holds (on GPU: every block it holds, lean)."""
        if self.filed:
            return self.fed.num_blocks_many(replicas, medium)
        return {r: self.num_blocks(r) for r in replicas}

    def replicas(self) -> list[str]:
        """The replicas, sorted."""
        return self.fed.replicas() if self.filed else sorted(self.caches)

    # ---- writes (none while the trees answer: the managers write them) -------------------
    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """Any write goes to the fed index, which answers from then on."""
        self.file_in_index()
        self.fed.store(replica, digests, medium)

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        self.file_in_index()
        self.fed.remove(replica, digests, medium)

    def clear(self, replica: str) -> None:
        self.file_in_index()
        self.fed.clear(replica)

    def drop_replica(self, replica: str) -> None:
        self.file_in_index()
        self.fed.drop_replica(replica)

    def _held(self, radix: RadixIndex, namespace: Namespace | None, chain: bytes, n: int) -> int:
        """Leading blocks of the ``n``-digest ``chain`` of ``namespace`` a replica's trees hold."""
        node: Node | None = radix.roots.get(namespace) if namespace is not None else None
        i = 0
        while node is not None and i < n:
            children = node.children
            if not children:
                break
            child = children.get(chain[i * D : (i + 1) * D])
            if child is None:
                break
            have = child.digests
            k = len(have) // D
            if k <= n - i and chain.startswith(have, i * D):  # the whole node
                i += k
                node = child
                continue
            m = 1  # its first digest matched: count the others
            end = min(k, n - i)
            at = i * D
            while m < end and have[m * D : (m + 1) * D] == chain[at + m * D : at + (m + 1) * D]:
                m += 1
            return i + m
        return i
