"""A sampled miss-ratio curve of an LRU block cache: SHARDS (Waldspurger et al., "Efficient MRC
Construction with SHARDS", FAST'15), fixed-size.

A block is in the sample when its digest, read as a 64-bit number, falls under a threshold
``T``; the sampling rate is ``T / 2**64``. For every reference to a sampled block the reuse
distance among sampled blocks (distinct sampled blocks referenced since its last reference) is
measured and scaled by ``1 / rate``: about the distance in the whole stream. The histogram of
scaled distances, each reference weighted ``1 / rate`` (its rate when it was taken), gives the
hits of an LRU cache of any size ``C``: the references at scaled distance below ``C``.

Fixed size: at most ``max_blocks`` sampled blocks are kept; past that, the block with the
largest hash leaves and the threshold drops to its hash, so memory is bounded whatever the
traffic (the rate adapts down, and later references weigh more).

A prefix cache evicts leaves first, so a prompt's blocks are referenced deepest first
(``reference_prompt``): a block is then always more recent than every block below it, the
blocks an LRU of size ``C`` holds form a leading run of the prompt, and the estimate is of
prefix hits.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

FULL = 1 << 64
MIN_TREE = 4096  # positions of the smallest reuse-distance tree


class CurvePoint(NamedTuple):
    """The estimated hits of an LRU cache of ``blocks`` blocks."""

    blocks: float
    hit_rate: float  # of the prompt tokens fed
    stderr: float  # an approximate standard error of ``hit_rate`` (binomial, sampled refs)


def sampled_hashes(digests: list[bytes], threshold: int) -> list[int]:
    """The sampling hashes (each digest's first 8 bytes, big-endian) under ``threshold``,
    deepest block first: the few a sample references. A digest whose first byte is over the
    threshold's is passed over without reading the rest (at 1%, all but about 1 in 100)."""
    top: int = (threshold - 1) >> 56
    out: list[int] = []
    for i in range(len(digests) - 1, -1, -1):
        d = digests[i]
        if d[0] <= top:
            h = int.from_bytes(d[:8], "big")
            if h < threshold:
                out.append(h)
    return out


class _Fenwick:
    """Counts over positions 1..n: add at a position, sum of a prefix, both O(log n)."""

    __slots__ = ("n", "tree")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, delta: int) -> None:
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        tree, total = self.tree, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class ShardsSampler:
    """The sampled reuse distances of one stream of block references."""

    def __init__(self, rate: float = 0.01, max_blocks: int = 32_768, block_size: int = 1) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks!r}")
        self.threshold = min(FULL, int(rate * FULL))
        self.max_blocks = max_blocks
        self.block_size = block_size
        self._last: dict[int, int] = {}  # sampled block's hash -> the time of its last reference
        self._by_hash: list[int] = []  # max-heap (negated) of the sampled blocks' hashes
        self._clock = 0  # references to sampled blocks so far (the time)
        # 1 at each live block's last time; sized to the live sample (4x, at least
        # MIN_TREE), so a small sample's walks stay in the CPU's cache
        self._times = _Fenwick(MIN_TREE)
        # bucket of scaled distance (``_bucket``) -> summed weight of its references
        self._hist: dict[int, float] = {}
        self.cold_weight = 0.0  # first references (compulsory misses), weighted
        self.sampled_refs = 0  # references to sampled blocks
        self.references = 0  # every block reference fed
        self.prompt_tokens = 0  # every prompt token fed

    @property
    def rate(self) -> float:
        """The sampling rate now."""
        return self.threshold / FULL

    @property
    def sampled_blocks(self) -> int:
        """Distinct sampled blocks kept now."""
        return len(self._last)

    def reference_prompt(self, digests: Sequence[bytes], prompt_tokens: int) -> None:
        """One prompt's full blocks (``digests``, root first) referenced deepest first, and its
        ``prompt_tokens`` counted."""
        hashes = sampled_hashes(list(digests), self.threshold)
        self.reference_hashes(hashes, len(digests), prompt_tokens)

    def reference_hashes(self, hashes: list[int], blocks: int, prompt_tokens: int) -> None:
        """``reference_prompt`` with the prompt's sampling hashes under (at least) this
        sample's threshold already picked, deepest first (``sampled_hashes``: one pass for
        several samples), of its ``blocks`` full blocks.

        Each block's distance is measured as the request finds the cache (a prefix cache
        matches the prompt before it allocates, so the prompt's new blocks never push its own
        prefix out), then the blocks are referenced deepest first."""
        self.prompt_tokens += prompt_tokens
        self.references += blocks
        threshold = self.threshold
        weight = FULL / threshold
        picked = [h for h in hashes if h < threshold]
        last_of, times = self._last, self._times
        for h in picked:
            self.sampled_refs += 1
            last = last_of.get(h)
            if last is None:
                self.cold_weight += weight
                continue
            # the live blocks referenced since: each has a 1 at its last time, after ``last``
            newer = self._clock - last - 1  # references since (0: none, so no block either)
            distinct = len(last_of) - times.prefix(last + 1) if newer else 0
            bucket = _bucket(distinct * weight)
            self._hist[bucket] = self._hist.get(bucket, 0.0) + weight
        for h in picked:
            if h >= self.threshold:  # left the sample as it filled
                continue
            last = self._last.get(h)
            if last is not None:
                self._times.add(last + 1, -1)
            self._place(h)
            if last is None:
                heapq.heappush(self._by_hash, -h)
                while len(self._last) > self.max_blocks:
                    self._drop_largest()

    def _place(self, h: int) -> None:
        """``h`` is referenced now: its time in the tree (renumbered when the tree is full)."""
        if self._clock + 1 > self._times.n:
            self._renumber()
        self._last[h] = self._clock
        self._times.add(self._clock + 1, 1)
        self._clock += 1

    def _renumber(self) -> None:
        """Give the live blocks consecutive times from 0, in their order, in a tree of four
        times their number (the tree is full)."""
        order = sorted(self._last.items(), key=lambda kv: kv[1])
        self._times = _Fenwick(max(MIN_TREE, 4 * len(order)))
        for i, (h, _) in enumerate(order):
            self._last[h] = i
            self._times.add(i + 1, 1)
        self._clock = len(order)

    def _drop_largest(self) -> None:
        """The sample is full: the block with the largest hash leaves, the threshold drops."""
        h = -heapq.heappop(self._by_hash)
        last = self._last.pop(h)
        self._times.add(last + 1, -1)
        self.threshold = h

    def hit_rate(self, blocks: float) -> CurvePoint:
        """The estimated token hit rate of an LRU prefix cache of ``blocks`` blocks."""
        hits = sum(w for b, w in self._hist.items() if _bucket_top(b) <= blocks)
        refs = self.references
        sampled = self.cold_weight + sum(self._hist.values())  # the references the sample saw
        block_rate = min(1.0, hits / sampled) if sampled else 0.0
        tokens = self.prompt_tokens
        rate = min(1.0, block_rate * refs * self.block_size / tokens) if tokens else 0.0
        n = self.sampled_refs
        stderr = math.sqrt(block_rate * (1 - block_rate) / n) if n else 0.0
        return CurvePoint(blocks, rate, stderr * (refs * self.block_size / tokens if tokens else 0))


_STEPS = 64  # histogram buckets per doubling of distance (about 1% apart)


def _bucket(distance: float) -> int:
    """The histogram bucket of a scaled distance: 0 for distance < 1, else 1 + 64 log2 d."""
    if distance < 1:
        return 0
    return 1 + int(_STEPS * math.log2(distance))


def _bucket_top(bucket: int) -> float:
    """The smallest cache (blocks) that holds every distance of ``bucket`` (a distance d hits
    a cache of more than d blocks)."""
    if bucket == 0:
        return 1.0
    return 2.0 ** (bucket / _STEPS)
