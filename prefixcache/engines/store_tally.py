"""Counters of a store's traffic, for both engines' integrations: named counts, bumped from any
thread, read as a delta since the last read (what an engine's per-interval stats want) and in
total. When a failing store is left alone is ``prefixcache.store.backend.StoreGate``.
"""

from __future__ import annotations

import threading
from collections import Counter


class StoreTally:
    """Counters, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: Counter[str] = Counter()
        self._since: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more of ``name``."""
        if n:
            with self._lock:
                self._total[name] += n
                self._since[name] += n

    def take_delta(self) -> dict[str, int]:
        """The counts since the last call (only those that moved)."""
        with self._lock:
            out, self._since = dict(self._since), Counter()
        return out

    def totals(self) -> dict[str, int]:
        """Every count since the connector started."""
        with self._lock:
            return dict(self._total)
