"""Which record the one-host store evicts first: the least recently used, tails before heads.

A query stops at the first block of a chain the store does not hold, so a block whose parent
is gone can never be loaded: evicting a chain's head first would leave its whole tail held and
worthless. The order keeps every chain whole from its head instead, and cheap enough that every
process sharing the store keeps it in the same LMDB transaction as its write.

Each record has an order key, kept in two tables (``blocks``: key -> order key and parent;
``order``: order key -> key), and the smallest order key is evicted first::

    epoch u64 | 2**32 - 1 - block index u32 | sequence u64        (big-endian: sorts as numbers)

- **Epochs** stand for time: the store's epoch advances each time ``1/EPOCHS`` of its
  capacity has been written. A write or a read (``touch``) moves a block to the current epoch,
  so blocks in use outlive blocks nobody used since (least recently used, to the epoch).
- **Within an epoch, deeper blocks go first** (the block index is inverted), and a block
  moved to the current epoch moves its ancestors with it (walking the parents until one is
  current already). So a parent's key is always above its children's (a parent is at least as
  recent, and shallower), and the smallest key is a block no held block continues: eviction
  takes tails before heads and never strands a block whose parent it took.
- **A block written when its parent is not held** (its head evicted, or never written) starts
  in epoch 0, below every reachable block: only the writer, which may hold the head on its
  GPU, could load it, so it goes first when space is short.

Moving a block costs three small writes; a walk stops at the first ancestor already current,
so a chain pays for its ancestors once an epoch.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

EPOCHS = 16  # epochs a capacity's worth of writes spans
STRANDED = 0  # the epoch of blocks written without their parent
_KEY = struct.Struct(">QIQ")  # epoch, inverted block index, sequence
_DEPTH = 0xFFFFFFFF


class OrderEntry(NamedTuple):
    """A held block's place in the eviction order."""

    epoch: int
    block_index: int
    sequence: int
    parent: bytes | None


def order_key(epoch: int, block_index: int, sequence: int) -> bytes:
    """The ``order`` table's key: smallest first out."""
    return _KEY.pack(epoch, _DEPTH - min(block_index, _DEPTH), sequence)


class UseOrder:
    """The eviction order of one store's records, in its ``blocks`` and ``order`` tables."""

    def __init__(self, blocks_db: Any, order_db: Any) -> None:
        self.blocks_db = blocks_db
        self.order_db = order_db

    def entry(self, txn: Any, key: bytes) -> OrderEntry | None:
        """``key``'s place, or None when it is not held."""
        raw = txn.get(key, db=self.blocks_db)
        if raw is None:
            return None
        raw = bytes(raw)
        epoch, inverted, sequence = _KEY.unpack_from(raw)
        parent = raw[_KEY.size :] or None
        return OrderEntry(epoch, _DEPTH - inverted, sequence, parent)

    def add(
        self,
        txn: Any,
        key: bytes,
        parent: bytes | None,
        block_index: int,
        epoch: int,
        sequence: int,
    ) -> None:
        """Place a new record: in ``epoch`` with its ancestors, or in the stranded epoch when
        ``parent`` is given and not held."""
        if parent is not None and self.entry(txn, parent) is None:
            epoch = STRANDED
        elif parent is not None:
            self.refresh(txn, parent, epoch)
        self._put(txn, key, OrderEntry(epoch, block_index, sequence, parent))

    def refresh(self, txn: Any, key: bytes, epoch: int) -> None:
        """Move ``key`` and its held ancestors to ``epoch`` (a use); stops at the first one
        already there."""
        current: bytes | None = key
        while current is not None:
            found = self.entry(txn, current)
            if found is None or found.epoch >= epoch:
                return
            txn.delete(order_key(found.epoch, found.block_index, found.sequence), db=self.order_db)
            self._put(txn, current, found._replace(epoch=epoch))
            current = found.parent

    def remove(self, txn: Any, key: bytes) -> None:
        """Forget ``key``'s place (its record is gone)."""
        found = self.entry(txn, key)
        if found is not None:
            txn.delete(order_key(found.epoch, found.block_index, found.sequence), db=self.order_db)
            txn.delete(key, db=self.blocks_db)

    def first(self, txn: Any) -> bytes | None:
        """The key evicted next, or None when nothing is held."""
        cursor = txn.cursor(db=self.order_db)
        return bytes(cursor.value()) if cursor.first() else None

    def keys(self, txn: Any) -> list[bytes]:
        """Every placed key, the next evicted first."""
        cursor = txn.cursor(db=self.order_db)
        return [bytes(v) for v in cursor.iternext(keys=False, values=True)]

    def _put(self, txn: Any, key: bytes, place: OrderEntry) -> None:
        okey = order_key(place.epoch, place.block_index, place.sequence)
        txn.put(okey, key, db=self.order_db)
        txn.put(key, okey + (place.parent or b""), db=self.blocks_db)
