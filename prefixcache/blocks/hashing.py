"""Chained 128-bit block hashes: h_i = H(h_{i-1} || start position || int32 token ids of block i).

The chain is seeded by the namespace, so equal tokens under another model, adapter or tenant never
share a digest. Digests are deterministic across processes and machines (no random seed).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Final

import numpy as np
import xxhash

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import TokenIds, as_token_array
from prefixcache.errors import ConfigError

DIGEST_SIZE: Final = 16
_SEED_PREFIX = b"prefixcache/ns/v2\x00"
_SEED_CACHE: Final = 4096  # namespaces whose seed is kept; older ones are recomputed on demand
_STARTS_CACHED: Final = 1 << 16  # block positions whose 8-byte encoding is kept (512 KiB at most)
_RECORDS_FROM: Final = 32  # blocks from which one numpy record buffer beats per-block slices


def split_digests(digests: bytes) -> list[bytes]:
    """Concatenated digests, one per block."""
    return [digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)]


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:DIGEST_SIZE]


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256_128,
}


class _Starts:
    """Block start positions computed on demand (sequences beyond the kept ones)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __getitem__(self, i: int) -> bytes:
        return (i * self.block_size).to_bytes(8, "little")


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens into a chain of 16-byte digests.

    Safe to share between threads (a router hashes outside its lock): its caches are replaced
    whole or changed under a lock, never grown in place while another thread reads them.
    """

    def __init__(self, block_size: int, algo: str = "xxh3_128") -> None:
        if algo not in HASH_FUNCTIONS:
            raise ConfigError(
                f"unknown hash algorithm {algo!r}; choose one of {sorted(HASH_FUNCTIONS)}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.algo = algo
        self.digest: Callable[[bytes], bytes] = HASH_FUNCTIONS[algo]
        self._seeds: dict[Namespace, bytes] = {}
        self._seeds_lock = threading.Lock()
        self._starts: list[bytes] = []  # start position of block i as 8 LE bytes, grown on demand

    def seed(self, namespace: Namespace) -> bytes:
        """h_{-1}: the digest every chain in ``namespace`` starts from."""
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self.digest(_SEED_PREFIX + namespace.canonical_bytes())
            with self._seeds_lock:
                seeds = self._seeds
                if len(seeds) >= _SEED_CACHE:  # bounded: one namespace per image must not grow
                    del seeds[next(iter(seeds))]
                seeds[namespace] = seed
        return seed

    def hash_block(self, parent: bytes, block_index: int, block_bytes: bytes) -> bytes:
        """Digest of one block given its parent digest and its int32 little-endian token bytes."""
        start = (block_index * self.block_size).to_bytes(8, "little")
        return self.digest(parent + start + block_bytes)

    def hash_blocks(
        self, tokens: np.ndarray, parent: bytes, first_block: int, end_block: int
    ) -> list[bytes]:
        """Digests of full blocks ``first_block .. end_block-1`` of a sequence.

        ``tokens`` is the sequence's validated ``<i4`` array from position 0; ``parent`` is the
        digest of block ``first_block - 1`` (the namespace seed when ``first_block`` is 0).
        """
        n = end_block - first_block
        if n <= 0:
            return []
        if n >= _RECORDS_FROM:
            return self._hash_records(tokens, parent, first_block, end_block)
        p = self.block_size
        body = tokens[first_block * p : end_block * p].tobytes()
        return self._hash_slices(body, -first_block * 4 * p, parent, first_block, end_block)

    def hash_buffer(
        self, buf: bytes | bytearray, parent: bytes, first_block: int, end_block: int
    ) -> list[bytes]:
        """``hash_blocks`` over the sequence's int32 LE token bytes (from position 0)."""
        n = end_block - first_block
        if n <= 0:
            return []
        if n >= _RECORDS_FROM:
            tokens = np.frombuffer(buf, dtype="<i4")
            return self._hash_records(tokens, parent, first_block, end_block)
        if type(buf) is not bytes:  # a growing sequence: only the blocks hashed are copied
            width = 4 * self.block_size
            body = bytes(buf[first_block * width : end_block * width])
            return self._hash_slices(body, -first_block * width, parent, first_block, end_block)
        return self._hash_slices(buf, 0, parent, first_block, end_block)

    def hash_run(self, body: bytes | bytearray, parent: bytes, first_block: int) -> list[bytes]:
        """Digests of a run of whole blocks whose int32 LE tokens are ``body``, the first being
        block ``first_block`` of its sequence (``parent`` the digest before it)."""
        n = len(body) // (4 * self.block_size)
        if n <= 0:
            return []
        base = -first_block * 4 * self.block_size
        return self._hash_slices(bytes(body), base, parent, first_block, first_block + n)

    def block_starts(self, end_block: int) -> list[bytes] | _Starts:
        """The start positions the chain mixes in (8 bytes LE), indexed by block, for blocks
        ``0 .. end_block-1``: a list kept for the first 65,536 blocks, computed beyond."""
        starts = self._starts
        if len(starts) < end_block:
            p = self.block_size
            if end_block > _STARTS_CACHED:
                return _Starts(p)
            # a longer list replaces the kept one (at least doubling it): readers of the old one
            # are unaffected, and two threads growing it at once both leave a correct list
            grow = min(_STARTS_CACHED, max(end_block, 2 * len(starts)))
            starts = starts + [(i * p).to_bytes(8, "little") for i in range(len(starts), grow)]
            self._starts = starts
        return starts

    def _hash_slices(
        self, body: bytes, base: int, parent: bytes, first_block: int, end_block: int
    ) -> list[bytes]:
        """Few blocks: one hash of (parent, position, block slice) each; block ``i`` starts at
        byte ``base + i * block_bytes`` of ``body``."""
        width = 4 * self.block_size
        starts = self.block_starts(end_block)
        if isinstance(starts, list):
            positions = starts[first_block:end_block]
        else:
            positions = [starts[i] for i in range(first_block, end_block)]
        digest = self.digest
        out: list[bytes] = []
        prev = parent
        offset = base + first_block * width
        for start in positions:  # bytes typed throughout: compiled, slices and joins are direct
            prev = digest(prev + start + body[offset : offset + width])
            out.append(prev)
            offset += width
        return out

    def _hash_records(
        self, tokens: np.ndarray, parent: bytes, first_block: int, end_block: int
    ) -> list[bytes]:
        """Many blocks: one record per block, [start position as int64 | token ids], in one
        buffer, so the loop does a single concatenation and a single hash call per block."""
        p = self.block_size
        n = end_block - first_block
        records = np.empty((n, p + 2), dtype="<i4")
        records[:, 2:] = tokens[first_block * p : end_block * p].reshape(n, p)
        start_ids = np.arange(first_block, end_block, dtype="<i8") * p
        records[:, :2] = start_ids.view("<i4").reshape(n, 2)
        buf: bytes = records.tobytes()
        width = (p + 2) * 4
        digest = self.digest
        out: list[bytes] = []
        prev = parent
        for offset in range(0, n * width, width):
            prev = digest(prev + buf[offset : offset + width])
            out.append(prev)
        return out

    def hash_prompt(self, tokens: TokenIds, namespace: Namespace) -> list[bytes]:
        """Digests of every full block of a prompt (any token container; validated)."""
        arr = as_token_array(tokens)
        return self.hash_blocks(arr, self.seed(namespace), 0, len(arr) // self.block_size)
