"""Deterministic token synthesis: counter-based, so a token depends only on (stream, position).

A stream is a 64-bit key derived from the seed and a name (a segment, a trace hash id). Tokens are
drawn uniformly from ``[0, vocab_size)``; the default vocabulary is the whole int31 range, so two
streams never share a token prefix by accident (a small vocabulary would make the cache find
one-token partial matches that the workload never declared).
"""

from __future__ import annotations

import numpy as np
import xxhash

FULL_VOCAB = 2**31 - 1  # the default vocabulary size: token ids in [0, 2**31 - 1)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over a uint64 array (a bijection; returns a new array)."""
    z = x + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def stream_key(*parts: object) -> int:
    """A stable 64-bit stream id (an int in ``[0, 2**64)``) from names and numbers, joined by
    their ``str``; the same on every machine."""
    return xxhash.xxh3_64_intdigest("\x1f".join(map(str, parts)).encode())


def stream_tokens(key: int, count: int, vocab_size: int = FULL_VOCAB, start: int = 0) -> np.ndarray:
    """Tokens ``start .. start+count-1`` of stream ``key`` (a 64-bit stream id) as a new
    int32 array, each in ``[0, vocab_size)``."""
    pos = np.arange(start, start + count, dtype=np.uint64)
    return _to_vocab(mix64(pos ^ np.uint64(key)), vocab_size)


def blocks_tokens(keys: np.ndarray, block_len: int, vocab_size: int = FULL_VOCAB) -> np.ndarray:
    """A new int32 array ``[len(keys), block_len]`` of tokens in ``[0, vocab_size)``: row i is
    the first ``block_len`` tokens of stream ``keys[i]`` (``keys``: 64-bit stream ids)."""
    pos = np.arange(block_len, dtype=np.uint64)
    grid = keys.astype(np.uint64)[:, None] ^ pos[None, :]
    return _to_vocab(mix64(grid), vocab_size)


def _to_vocab(z: np.ndarray, vocab_size: int) -> np.ndarray:
    """Mixed uint64 values as int32 token ids in ``[0, vocab_size)``."""
    return (z % np.uint64(vocab_size)).astype("<i4")


class TokenTape:
    """Fresh tokens for unique prompt parts: stream ``key`` read forward, in pre-drawn chunks
    of ``chunk`` tokens (cheap per call); ids in ``[0, vocab_size)``."""

    def __init__(self, key: int, vocab_size: int = FULL_VOCAB, chunk: int = 1 << 18) -> None:
        self._key, self._vocab, self._chunk = key, vocab_size, chunk
        self._pos = 0  # tokens drawn so far from the stream
        self._buf = np.zeros(0, dtype="<i4")
        self._off = 0

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` tokens (int32), never handed out before; a view of the tape's chunk,
        not to be written. The same sequence of calls gives the same tokens."""
        if self._off + n > len(self._buf):
            size = max(n, self._chunk)
            self._buf = stream_tokens(self._key, size, self._vocab, self._pos)
            self._pos += size
            self._off = 0
        out = self._buf[self._off : self._off + n]
        self._off += n
        return out
