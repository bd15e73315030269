"""Transactions of one process share the store's memory map; changing the map waits for them.

LMDB remaps the file when its map size changes (``set_mapsize``), which must not happen while
any transaction of the process is open: a read in another thread would hold pointers into the
old map. Operations run under ``shared()`` (any number at once); a map change under
``exclusive()``, which lets the open ones finish and holds new ones until it is done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class MapGate:
    """Many operations at once, or one map change alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._changing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        """An operation on the map as it is."""
        with self._cond:
            while self._changing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """A change of the map, with no operation in flight."""
        with self._cond:
            while self._changing:
                self._cond.wait()
            self._changing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._changing = False
                self._cond.notify_all()
