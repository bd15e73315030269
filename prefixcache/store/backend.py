"""What a K/V block store must do for the connector: four operations over opaque keys; how a
backend imports the client library it wraps; and when to leave a failing store alone
(``StoreGate``: for ``retry_after`` seconds the store is not asked, so a store that is down or
stalled costs the steps nothing; ``read_checked`` reads one record through it and checks it).

Keys are block digests (16 bytes; the namespace is already in the digest, so tenants, models
and adapters never share a key) and values are whole records (block_record.py). A backend
checks nothing: the connector checks every record it reads.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, TypeVar

import numpy as np

from prefixcache.errors import ConfigError
from prefixcache.store.block_record import BlockLayout, Refusal, check_record

_T = TypeVar("_T")


class StoreUnavailableError(RuntimeError):
    """The store cannot be reached or refused the operation; the caller recomputes."""


def import_client(name: str, install: str) -> ModuleType:
    """The client library ``name`` (``lmdb``, ``mooncake.store``) a backend module wraps, imported
    when the backend opens. The backend modules share the libraries' names (``lmdb.py``,
    ``mooncake.py``); imports are absolute, so the library is what they find, except where
    Python runs with this folder on its path (started from inside it) and the module hides the
    library: ConfigError says so. ConfigError too when the library is missing (``install``: how
    to install it)."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        _refuse_hidden(name.partition(".")[0])
        raise ConfigError(f"{install} ({exc})") from None
    _refuse_hidden(name.partition(".")[0])
    return module


def _refuse_hidden(library: str) -> None:
    """ConfigError when the module imported as ``library`` is one of this folder's."""
    found = getattr(sys.modules.get(library), "__file__", None)
    if found and Path(found).resolve().parent == Path(__file__).resolve().parent:
        raise ConfigError(
            f"the {library} library is hidden by {found}: Python runs with "
            f"{Path(found).parent} on its path (started from inside that folder); start it "
            "from another folder"
        )


def leading_held(held: Sequence[bool]) -> int:
    """How many of ``held`` (an ``exists`` answer), from the first, are held: what a prefix
    can load."""
    for i, present in enumerate(held):
        if not present:
            return i
    return len(held)


class BlockPlace(NamedTuple):
    """Where a block sits in its chain: the key of the block before it (None: the chain's first
    block) and its index in the chain (0 for the first). A store that knows it keeps whole
    chains: a block whose parent is gone cannot be loaded, a query stopping there."""

    parent: bytes | None
    block_index: int


class KVBlockStore(ABC):
    """A shared store of block records. Every method may raise ``StoreUnavailableError``."""

    name: str = "store"

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held now, in one round trip."""

    @abstractmethod
    def get_into(self, key: bytes, out: memoryview) -> int | None:
        """Copy the value of ``key`` into ``out`` (at least as long as the value); returns its
        length, or None when the key is not held. A value longer than ``out`` is not copied
        and returns its length (the caller refuses it)."""

    @abstractmethod
    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        *,
        places: Mapping[bytes, BlockPlace] | None = None,
        replace: Collection[bytes] = (),
    ) -> int:
        """Store each ``(key, value)``; returns how many were stored new. A key held already
        keeps its value (equal digests, equal K/V) unless it is in ``replace`` (a held record
        the caller found bad: the value recomputed replaces it). ``places`` says where keys
        sit in their chains (a store may ignore it)."""

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027  # optional: no use order
        """The blocks ``keys`` were just used (loaded): a store that evicts by use keeps them
        longer. A store whose eviction runs elsewhere, as Mooncake's master, ignores it."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop ``key`` (a record the connector refused), if held."""

    @abstractmethod
    def evicted(self) -> int:
        """Records the store's own eviction dropped so far (for this store, or as the
        backend can tell)."""

    def take_evicted_keys(self) -> list[bytes]:
        """Keys this process's writes evicted since the last call (for announcements; a store
        whose eviction runs elsewhere, as Mooncake's master, gives none)."""
        return []

    def close(self) -> None:  # noqa: B027  # optional: backends without resources skip it
        """Let go of the store's resources."""


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

    def ask(self, operation: Callable[[], _T]) -> _T | None:
        """``operation()``'s answer from the store, or None while the store is left alone or
        when it fails now (which leaves it alone)."""
        if not self.is_open():
            return None
        try:
            return operation()
        except StoreUnavailableError as exc:
            self.failed(exc)
            return None

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
