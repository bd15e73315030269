"""What a K/V block store must do for the connector: four operations over opaque keys.

Keys are block digests (16 bytes; the namespace is already in the digest, so tenants, models
and adapters never share a key) and values are whole records (block_record.py). A backend
checks nothing: the connector checks every record it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple


class StoreUnavailableError(RuntimeError):
    """The store cannot be reached or refused the operation; the caller recomputes."""


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
