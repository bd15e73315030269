"""One stored block: a header that says exactly what the bytes are, then the K/V of every layer.

A record is the header (fixed fields, then the dtype name) followed by the payload: per layer,
the block's K then its V, each ``shape`` of ``dtype`` in C order. The header carries the block
digest, a fingerprint of its namespace, the layout (block size, layer count, dtype, per-layer
shape) and an xxh3-128 checksum of the payload. ``check_record`` compares every field with
what the reader expects and the checksum with the bytes it holds: a record of another model's
layout, another namespace, another block, a torn or corrupt value is refused with a
``Refusal`` naming which, and its bytes are never used.

    magic "PCKV" | version u8 | dtype length u8 | ndim u8 | pad u8 | digest 16 |
    namespace fingerprint 16 | block_size u32 | num_layers u32 | payload bytes u64 |
    checksum 16 | shape u32 x ndim | dtype (ASCII) | zeros to a multiple of 16 bytes

All integers little-endian.
"""

from __future__ import annotations

import struct
from enum import Enum
from math import prod
from typing import Any, NamedTuple

import xxhash

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError

MAGIC = b"PCKV"
VERSION = 1
_FIXED = struct.Struct("<4sBBBx16s16sIIQ16s")  # up to the shape


class Refusal(Enum):
    """Why a stored value is not used."""

    MISSING = "missing"  # not in the store (evicted, never written)
    TRUNCATED = "truncated"  # shorter than its header says (a torn write)
    NOT_A_RECORD = "not_a_record"  # no magic, or another version: a foreign writer
    DIGEST = "digest"  # another block's record under this key
    NAMESPACE = "namespace"  # another namespace's block
    LAYOUT = "layout"  # another block size, layer count, dtype or shape
    CHECKSUM = "checksum"  # the payload's bytes are not the ones written
    ERROR = "error"  # the store failed to answer


class BlockLayout(NamedTuple):
    """How one block's K/V is laid out: ``num_layers`` x (K, V) of ``shape`` (one layer's K of
    one block, e.g. ``(block_size, num_kv_heads, head_dim)``) in ``dtype`` (a torch or numpy
    dtype name such as ``"float16"``), ``itemsize`` bytes an element."""

    block_size: int
    num_layers: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one block."""
        return prod(self.shape) * self.itemsize

    @property
    def payload_bytes(self) -> int:
        """K and V of every layer."""
        return 2 * self.num_layers * self.layer_bytes

    @property
    def header_bytes(self) -> int:
        """The header's size for this layout (padded to 16 bytes, so the payload is aligned
        for any dtype)."""
        return _padded(_FIXED.size + 4 * len(self.shape) + len(self.dtype.encode("ascii")))

    @property
    def record_bytes(self) -> int:
        """Header and payload."""
        return self.header_bytes + self.payload_bytes

    def check(self) -> BlockLayout:
        """The layout, or ConfigError saying which figure is unusable."""
        for name in ("block_size", "num_layers", "itemsize"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout {name} must be a positive int, got {value!r}")
        if not self.shape or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.shape
        ):
            raise ConfigError(f"layout shape must be positive ints, got {self.shape!r}")
        if not self.dtype.isascii() or not 0 < len(self.dtype) < 32:
            raise ConfigError(f"layout dtype must be a short ASCII name, got {self.dtype!r}")
        return self


def namespace_fingerprint(namespace: Namespace) -> bytes:
    """16 bytes naming a namespace (model, adapter, salt, extra) in a record header."""
    return xxhash.xxh3_128_digest(b"prefixcache-namespace\x00" + namespace.canonical_bytes())


def payload_checksum(payload: Any) -> bytes:
    """The xxh3-128 checksum a header carries (of any contiguous buffer)."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(
    digest: bytes, namespace_fp: bytes, layout: BlockLayout, checksum: bytes
) -> bytes:
    """The header of a record whose payload has ``checksum``."""
    dtype = layout.dtype.encode("ascii")
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        len(dtype),
        len(layout.shape),
        digest,
        namespace_fp,
        layout.block_size,
        layout.num_layers,
        layout.payload_bytes,
        checksum,
    )
    header = fixed + struct.pack(f"<{len(layout.shape)}I", *layout.shape) + dtype
    return header + bytes(_padded(len(header)) - len(header))


def _padded(n: int) -> int:
    return -(-n // 16) * 16


def check_record(
    record: memoryview, digest: bytes, namespace_fp: bytes, layout: BlockLayout
) -> Refusal | None:
    """None when ``record`` is block ``digest`` of the namespace and ``layout``, whole and
    intact; else the first reason it is not (the checksum is computed last, over the bytes in
    ``record``, which the caller then uses as they are)."""
    if len(record) < _FIXED.size:
        return Refusal.TRUNCATED if bytes(record[:4]) == MAGIC else Refusal.NOT_A_RECORD
    magic, version, dlen, ndim, got_digest, got_ns, bsize, layers, nbytes, checksum = (
        _FIXED.unpack_from(record)
    )
    if magic != MAGIC or version != VERSION:
        return Refusal.NOT_A_RECORD
    if got_digest != digest:
        return Refusal.DIGEST
    if got_ns != namespace_fp:
        return Refusal.NAMESPACE
    named = _FIXED.size + 4 * ndim + dlen
    header = _padded(named)
    if len(record) < header:
        return Refusal.TRUNCATED
    shape = struct.unpack_from(f"<{ndim}I", record, _FIXED.size)
    dtype = bytes(record[_FIXED.size + 4 * ndim : named])
    expected = (layout.block_size, layout.num_layers, layout.shape, layout.dtype.encode("ascii"))
    if (bsize, layers, shape, dtype) != expected or nbytes != layout.payload_bytes:
        return Refusal.LAYOUT
    if len(record) != header + nbytes:
        return Refusal.TRUNCATED
    if payload_checksum(record[header:]) != checksum:
        return Refusal.CHECKSUM
    return None
