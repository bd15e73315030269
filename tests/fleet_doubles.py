"""A small in-memory ``FleetIndex`` for the router and service tests and the route benchmark.

Digest -> {replica: set of media}. Holdings are prefix-closed per the contract (and, here, per
medium), so ``match`` binary-searches each replica's end of the chain. Thread-safe with one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prefixcache.fleet.fleet_index import GPU, MEDIA, ReplicaMatch


class DictFleetIndex:
    """Reference implementation of ``prefixcache.fleet.fleet_index.FleetIndex`` for tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, dict[str, set[str]]] = {}
        self._counts: dict[str, int] = {}

    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        if medium not in MEDIA:
            raise ValueError(f"unknown medium {medium!r}")
        with self._lock:
            self._counts.setdefault(replica, 0)
            for digest in digests:
                media = self._holders.setdefault(digest, {}).setdefault(replica, set())
                if not media:
                    self._counts[replica] += 1
                media.add(medium)

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        with self._lock:
            for digest in digests:
                holders = self._holders.get(digest)
                media = holders.get(replica) if holders else None
                if media is None or holders is None:
                    continue
                if medium is None:
                    media.clear()
                else:
                    media.discard(medium)
                if not media:
                    del holders[replica]
                    self._counts[replica] -= 1
                    if not holders:
                        del self._holders[digest]

    def clear(self, replica: str) -> None:
        with self._lock:
            for digest in [d for d, h in self._holders.items() if replica in h]:
                del self._holders[digest][replica]
                if not self._holders[digest]:
                    del self._holders[digest]
            if replica in self._counts:
                self._counts[replica] = 0

    def drop_replica(self, replica: str) -> None:
        self.clear(replica)
        with self._lock:
            self._counts.pop(replica, None)

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        with self._lock:
            known = sorted(self._counts)
            return [
                ReplicaMatch(name, self._held(name, digests, None), self._held(name, digests, GPU))
                for name in known
            ]

    def _held(self, replica: str, digests: Sequence[bytes], medium: str | None) -> int:
        """Leading blocks of ``digests`` held (on ``medium``): a binary search, as holdings are
        prefix-closed."""
        lo, hi = 0, len(digests)  # blocks [0, lo) are held; [hi, ...) are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            media = self._holders.get(digests[mid - 1], {}).get(replica)
            if media and (medium is None or medium in media):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._counts)

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return self._counts.get(replica, 0)
