"""Transactions of one process share the store's memory map; changing the map waits for them.

LMDB remaps the file when its map size changes (``set_mapsize``), which must not happen while
any transaction of the process is open: a read in another thread would hold pointers into the
old map. Operations run inside the gate (``with gate:``, any number at once, one lock taken
twice: a fraction of a microsecond); a map change under ``exclusive()``, which lets the open
ones finish and holds new ones until it is done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class MapGate:
    """Many operations at once (``with gate:``), or one map change alone (``exclusive()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._changing = False

    def __enter__(self) -> None:
        with self._lock:
            while self._changing:
                self._cond.wait()
            self._active += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._active -= 1
            if self._changing and not self._active:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """A change of the map, with no operation in flight."""
        with self._lock:
            while self._changing:
                self._cond.wait()
            self._changing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._changing = False
                self._cond.notify_all()
