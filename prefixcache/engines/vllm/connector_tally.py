"""What the store connector counts, and when it leaves a failing store alone.

``StoreTally`` holds the counters both roles keep (queries on the scheduler's side; loads,
refusals and writes on the worker's), read as a delta since the last read for vLLM's
``KVConnectorStats`` and in total for the log. ``StoreGate`` remembers a failure: for
``retry_after`` seconds the store is not asked (queries find nothing, loads recompute, writes
are dropped), so a store that is down or stalled costs the steps nothing; the first failure of
a spell is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

# under vLLM's logger, so the lines come out with vLLM's own (its handler is on "vllm")
LOGGER = "vllm.prefixcache_store"
log = logging.getLogger(LOGGER)

COUNTERS = (
    "queries",  # existence queries (one per request, batched)
    "query_errors",  # queries the store failed to answer (nothing found)
    "queried_blocks",  # blocks asked about
    "found_blocks",  # leading blocks the queries found
    "loaded_blocks",  # blocks loaded into vLLM's cache, checked
    "load_failed_blocks",  # blocks reported to vLLM to recompute (refused or not loaded)
    "skipped_blocks",  # computed blocks not written: their request's load failed in the step
    "queued_blocks",  # computed blocks handed to the background writer
    "written_blocks",  # blocks the store took as new
    "dropped_blocks",  # blocks not written: the write queue was full or the store down
    "write_errors",  # blocks not written: the store failed the write
    "evicted_blocks",  # blocks the store evicted to take this process's writes
    "unannounced_removals",  # blocks that left the store whose vLLM hash was not known here
)


class StoreTally:
    """Counters, safe to bump from any thread. ``refused_<reason>`` counts records refused on
    load by reason (missing, checksum, layout, namespace, digest, truncated, not_a_record,
    error)."""

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


class StoreGate:
    """Whether the store may be asked now; a failure closes it for ``retry_after`` seconds."""

    def __init__(self, retry_after: float, what: str) -> None:
        self.retry_after = retry_after
        self.what = what
        self._until = 0.0
        self._lock = threading.Lock()

    def is_open(self) -> bool:
        """False while the store is left alone after a failure."""
        return not self._until or time.monotonic() >= self._until

    def failed(self, exc: Exception) -> None:
        """The store failed: leave it alone for ``retry_after`` seconds (logged once a spell;
        failures while it is left alone do not extend the spell)."""
        now = time.monotonic()
        with self._lock:
            if now < self._until:
                return
            self._until = now + self.retry_after
        log.warning(
            "prefixcache store unavailable to the %s (%s): computing instead for %.1f s",
            self.what,
            exc,
            self.retry_after,
        )
