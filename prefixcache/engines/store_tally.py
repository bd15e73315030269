"""Counters of a store's traffic, and when to leave a failing store alone: for both engines'
integrations.

``StoreTally`` holds named counts, bumped from any thread, read as a delta since the last read
(what an engine's per-interval stats want) and in total. ``StoreGate`` remembers a failure: for
``retry_after`` seconds the store is not asked (queries find nothing, loads are computed
instead, writes are dropped), so a store that is down or stalled costs the engine's steps
nothing; the first failure of a spell is logged once, on the logger given. ``read_checked`` reads
one record through the gate and checks it, as both engines' loads do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import numpy as np

from prefixcache.store.backend import KVBlockStore, StoreUnavailableError
from prefixcache.store.block_record import BlockLayout, Refusal, check_record


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


class StoreGate:
    """Whether the store may be asked now; a failure closes it for ``retry_after`` seconds."""

    def __init__(self, retry_after: float, what: str, log: logging.Logger) -> None:
        self.retry_after = retry_after
        self.what = what
        self.log = log
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
        self.log.warning(
            "prefixcache store unavailable to the %s (%s): computing instead for %.1f s",
            self.what,
            exc,
            self.retry_after,
        )

    def read_checked(
        self, store: KVBlockStore, digest: bytes, out: np.ndarray, fp: bytes, layout: BlockLayout
    ) -> Refusal | None:
        """Read the record of ``digest`` into ``out`` and check it (None: usable): ERROR while
        the store is left alone or when it fails (which leaves it alone), MISSING when it does
        not hold the key, LAYOUT when the record is longer than ``out``."""
        if not self.is_open():
            return Refusal.ERROR
        try:
            n = store.get_into(digest, out.data)
        except StoreUnavailableError as exc:
            self.failed(exc)
            return Refusal.ERROR
        if n is None:
            return Refusal.MISSING
        if n > len(out):
            return Refusal.LAYOUT
        return check_record(out.data[:n], digest, fp, layout)
