"""A sampled miss-ratio curve of an LRU block cache: SHARDS (Waldspurger et al., "Efficient MRC
Construction with SHARDS", FAST'15), fixed-size.

A block is in the sample when its digest, read as a 64-bit number, falls under a threshold
``T``; the sampling rate is ``T / 2**64``. For every reference to a sampled block the reuse
distance among sampled blocks (distinct sampled blocks referenced since its last reference) is
measured and scaled by ``1 / rate``: about the distance in the whole stream. The histogram of
scaled distances, each reference weighted ``1 / rate`` (its rate when it was taken), gives the
hits of an LRU cache of any size ``C``: the references at scaled distance below ``C``.

The sample holds more or fewer references than its rate promises, by far on hot prefixes (a
system prompt's few blocks, in the sample or not, can carry a fifth of the references). Two
splits of the references correct that:

- by depth in the prompt (``STRATA``: the first block, the second, the next two, the next
  four, ...): the references at each depth are known exactly (every prompt's length is), so
  each stratum's shortfall or surplus is measured against its own true count, and a system
  prompt's blocks are compared with the prompt heads alone, not with every conversation's
  history;
- by random group (``GROUPS``, by the hash's low bits, which the sampling test does not
  read): within each stratum the groups say what a missing or surplus reference is worth
  (``group_regression``) and give a delete-a-group jackknife error.

The curve itself comes from one histogram of every sampled reference, 64 buckets a doubling;
the strata and groups keep coarser counts (a bucket a doubling, ``COARSE``) in a fixed array,
enough for the correction, which is added to the fine curve. So a sample's memory is its
blocks plus a fixed ``FIXED_BYTES``, whatever the traffic.

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

from prefixcache.fleet.whatif.group_regression import GROUPS, stratified_share

FULL = 1 << 64
STRATA = 12  # depth strata: depth 0, 1, 2-3, 4-7, ..., 512-1023, and 1024 on
COARSE = 48  # the strata's and groups' distance buckets: under 1, then one a doubling
FIXED_BYTES = 640 * 1024  # a sample's memory besides its blocks (histograms, counts), at most
MIN_TREE = 4096  # positions of the smallest reuse-distance tree


class CurvePoint(NamedTuple):
    """The estimated hits of an LRU cache of ``blocks`` blocks."""

    blocks: float
    hit_rate: float  # of the prompt tokens fed
    stderr: float  # a standard error of ``hit_rate`` (jackknife over the sample's groups)


def sampled_hashes(digests: list[bytes], threshold: int) -> list[tuple[int, int]]:
    """The sampling hashes (each digest's first 8 bytes, big-endian) under ``threshold``, with
    their depth in the prompt, deepest block first: the few a sample references. A digest
    whose first byte is over the threshold's is passed over without reading the rest (at 1%,
    all but about 1 in 100)."""
    top: int = (threshold - 1) >> 56
    out: list[tuple[int, int]] = []
    for i in range(len(digests) - 1, -1, -1):
        d = digests[i]
        if d[0] <= top:
            h = int.from_bytes(d[:8], "big")
            if h < threshold:
                out.append((h, i))
    return out


def sampled_depths(digests: Sequence[bytes], threshold: int) -> list[int]:
    """The depths (from the root) of the digests whose sampling hash is under ``threshold``,
    root first (the same test as ``sampled_hashes``; the shadow fleets' sample)."""
    top: int = (threshold - 1) >> 56
    out: list[int] = []
    for i in range(len(digests)):
        d = digests[i]
        if d[0] <= top and int.from_bytes(d[:8], "big") < threshold:
            out.append(i)
    return out


def stratum(depth: int) -> int:
    """The depth stratum of a block ``depth`` blocks from the prompt's root."""
    return min(STRATA - 1, depth.bit_length())


def add_stratum_counts(counts: list[int], blocks: int) -> None:
    """Add a prompt's ``blocks`` full blocks to ``counts``, the blocks of each depth stratum."""
    lo, s = 0, 0
    while lo < blocks:
        hi = 1 << s if s < STRATA - 1 else blocks
        counts[s] += min(blocks, hi) - lo
        lo, s = hi, s + 1


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

    def move(self, old: int, new: int) -> None:
        """The 1 at position ``old`` moves to ``new``: both update paths rise until they meet,
        where the -1 and the +1 cancel (a block referenced again soon walks a few nodes)."""
        tree, n = self.tree, self.n
        i, j = old, new
        while i != j:
            if i < j:
                if i > n:
                    return
                tree[i] -= 1
                i += i & -i
            else:
                if j > n:
                    return
                tree[j] += 1
                j += j & -j

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
        # ((stratum x GROUPS + group) x COARSE + coarse bucket) -> summed weight
        self._cells = [0.0] * (STRATA * GROUPS * COARSE)
        # first references (compulsory misses), weighted, by stratum x GROUPS + group
        self._cold = [0.0] * (STRATA * GROUPS)
        self._expected = [0] * STRATA  # every block reference fed, by depth stratum
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

    def reference_hashes(
        self, hashes: list[tuple[int, int]], blocks: int, prompt_tokens: int
    ) -> None:
        """``reference_prompt`` with the prompt's sampling hashes under (at least) this
        sample's threshold already picked, deepest first (``sampled_hashes``: one pass for
        several samples), of its ``blocks`` full blocks.

        Each block's distance is measured as the request finds the cache (a prefix cache
        matches the prompt before it allocates, so the prompt's new blocks never push its own
        prefix out), then the blocks are referenced deepest first."""
        self.prompt_tokens += prompt_tokens
        self.references += blocks
        add_stratum_counts(self._expected, blocks)
        threshold = self.threshold
        weight = FULL / threshold
        picked = [h for h, _ in hashes if h < threshold]
        last_of, times, hist, cells = self._last, self._times, self._hist, self._cells
        live = len(last_of)
        for h, depth in hashes:
            if h >= threshold:
                continue
            last = last_of.get(h)
            cell = stratum(depth) * GROUPS + h % GROUPS
            if last is None:
                self._cold[cell] += weight
                continue
            # the live blocks referenced since: each has a 1 at its last time, after ``last``
            # (none when no reference came since)
            since = live - times.prefix(last + 1) if self._clock - last - 1 else 0
            bucket = _bucket(since * weight)
            hist[bucket] = hist.get(bucket, 0.0) + weight
            cells[cell * COARSE + _coarse_of(bucket)] += weight
        self.sampled_refs += len(picked)
        for h in picked:
            if h >= self.threshold:  # left the sample as it filled
                continue
            last = last_of.get(h)
            if last is not None:
                self._place(h, last)
            else:
                self._place(h, -1)
                heapq.heappush(self._by_hash, -h)
                while len(last_of) > self.max_blocks:
                    self._drop_largest()

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree holds a 1 at each live block's last time and
        nothing else, the heap holds the live hashes, and every live hash is under the
        threshold."""
        times, live = self._times, len(self._last)
        if times.prefix(times.n) != live:
            raise AssertionError(f"the tree counts {times.prefix(times.n)} blocks, {live} live")
        for h, t in self._last.items():
            if times.prefix(t + 1) - times.prefix(t) != 1:
                raise AssertionError(f"block {h:#x}: no 1 at its time {t}")
            if h >= self.threshold:
                raise AssertionError(f"block {h:#x} is not under the threshold")
        if sorted(-x for x in self._by_hash) != sorted(self._last):
            raise AssertionError("the heap and the live blocks differ")

    def _place(self, h: int, last: int) -> None:
        """``h`` is referenced now (``last``: its time before, -1 when new): its time in the
        tree (renumbered when the tree is full)."""
        if self._clock + 1 > self._times.n:
            if last >= 0:
                self._times.add(last + 1, -1)
                del self._last[h]
            self._renumber()
            last = -1
        if last >= 0:
            self._times.move(last + 1, self._clock + 1)
        else:
            self._times.add(self._clock + 1, 1)
        self._last[h] = self._clock
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
        """The estimated token hit rate of an LRU prefix cache of ``blocks`` blocks: the share
        of block references that hit (the sampled share, corrected for each depth stratum's
        shortfall or surplus by its groups, weighed by its true references), times the blocks'
        share of the prompt tokens. The standard error is the groups' jackknife, times the
        finite-sample factor (none at rate 1)."""
        refs = self.references
        tokens = self.prompt_tokens
        if not tokens or not self.sampled_refs:
            return CurvePoint(blocks, 0.0, 0.0)
        fine = sum(w for b, w in self._hist.items() if _bucket_top(b) <= blocks)
        hits: list[list[float]] = []  # coarse weighted hits, by stratum and group
        seen: list[list[float]] = []  # weighted references the sample saw, alike
        cells, cold = self._cells, self._cold
        reach = 0  # coarse buckets wholly under ``blocks``
        while reach < COARSE and _coarse_top(reach) <= blocks:
            reach += 1
        coarse = 0.0
        for s in range(STRATA):
            hit_row, seen_row = [0.0] * GROUPS, [0.0] * GROUPS
            for g in range(GROUPS):
                base = (s * GROUPS + g) * COARSE
                h = sum(cells[base : base + reach])
                hit_row[g] = h
                seen_row[g] = cold[s * GROUPS + g] + h + sum(cells[base + reach : base + COARSE])
                coarse += h
            hits.append(hit_row)
            seen.append(seen_row)
        unit = FULL / self.threshold  # what a sampled reference counts for now
        expected = [float(n) for n in self._expected]
        share, error = stratified_share(hits, seen, expected, unit)
        # the correction, from the coarse counts, added to the fine curve
        share += (fine - coarse) / refs
        scale = refs * self.block_size / tokens  # the blocks' share of the prompt tokens
        keep = math.sqrt(max(0.0, 1.0 - self.rate))  # no sampling error at rate 1
        rate = min(1.0, max(0.0, share * scale))
        return CurvePoint(blocks, rate, error * scale * keep)


_STEPS = 64  # histogram buckets per doubling of distance (about 1% apart)


def _bucket(distance: float) -> int:
    """The histogram bucket of a scaled distance: 0 for distance < 1, else 1 + 64 log2 d."""
    if distance < 1:
        return 0
    return 1 + int(_STEPS * math.log2(distance))


def _coarse_of(bucket: int) -> int:
    """The coarse bucket of a fine ``bucket``: 0 under 1, else 1 + int(log2 d) (at most the
    last), as ``_bucket``'s 1 + int(64 log2 d) gives it."""
    if bucket == 0:
        return 0
    return min(COARSE - 1, 1 + (bucket - 1) // _STEPS)


def _coarse_top(bucket: int) -> float:
    """The smallest cache (blocks) that holds every distance of coarse ``bucket``."""
    return 2.0**bucket


def _bucket_top(bucket: int) -> float:
    """The smallest cache (blocks) that holds every distance of ``bucket`` (a distance d hits
    a cache of more than d blocks)."""
    if bucket == 0:
        return 1.0
    return 2.0 ** (bucket / _STEPS)
