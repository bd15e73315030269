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

The error has three parts, added as independent: the groups' delete-a-group jackknife (which
blocks the sample drew), the doubt of a stratum's hot correction (``group_regression``), and
the distances' own error. A sampled distance counts the sampled blocks in a stretch of the
stream, a binomial draw from the blocks truly there, so at 1% a distance of 25,000 blocks is
off by 6%; where the curve is steep that moves the hit rate by tenths of a point, alike for
every reference whose stretch overlaps (the groups, whose distances are not measured again,
cannot show it). So each reference's distance is also measured in one random half of the
sample for each of ``SPLITS`` splits (the three counts packed in the values of a second
reuse-distance tree: one more walk for the three): a split's two halves disagree by the
distances' error, and the disagreement, summed by distance (``SHIFT_STEPS`` buckets a
doubling) and read at the cache size, is a half-sample replicate of it (the shift of each
distance, to first order). Three splits, not four: a fourth field would make the packed values
wider than a machine word, which cost the route path more than the estimate gains.

A sampled distance is a whole number of sampled blocks, each standing for ``1 / rate`` blocks:
a reference at sampled distance ``d`` counts as a hit of a cache of ``C`` blocks by
``clip((C - d) rate, 0, 1)``, which over a binomial draw of the distance is right on average
(a hard ``d < C`` reads a few tenths of a point high at 1%, where ``C rate`` is a few tens of
blocks).

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

FULL = 1 << 64  # sampling hashes are 64-bit: a rate r samples those under r x FULL
STRATA = 12  # depth strata: depth 0, 1, 2-3, 4-7, ..., 512-1023, and 1024 on
COARSE = 48  # the strata's and groups' distance buckets: under 1, then one a doubling
FIXED_BYTES = 704 * 1024  # a sample's memory besides its blocks (histograms, counts), at most
MIN_TREE = 4096  # positions of the smallest reuse-distance tree
SPLITS = 3  # random halves of the sample, each measuring the distances again (their error)
SPLIT_BITS = 4  # the hash bits the halves read: above the group's (``h % GROUPS``)
FIELD = 20  # bits of each half's count packed in the halves' tree values
MASK = (1 << FIELD) - 1
MAX_BLOCKS = MASK  # sampled blocks a sample can keep (a packed count must fit its field)
_STEPS = 64  # histogram buckets per doubling of distance (about 1% apart)
SHIFT_STEPS = 8  # the halves' distance shifts are summed in 8 buckets a doubling
SHIFT_BUCKETS = SHIFT_STEPS * COARSE + 2
# the jackknife's 16 groups give its variance 15 degrees of freedom: +-2 standard errors of a
# Student t with 15 of them cover 93.6%, so the error is scaled by t(15) at the normal's 97.7%
# over 2 (2.18 / 2), for +-2 of it to cover what 2 standard deviations of a known error would
STUDENT = 1.09
# fewer sampled blocks cannot answer (``ShardsSampler.answers``): over 20 seeds of small
# samples (the first 100-3,200 requests of the Mooncake trace, a chat scenario and a document
# workload, 16- and 128-token blocks, 1-10%), the truth fell within 2 standard errors at 0% of
# the points with no sampled block, 47% with one, 62-81% with 2-15, 88% with 16-31, 91% with
# 32-63 (their errors 12 points), 93% with 64-127 and 95% past that
MIN_SAMPLED_BLOCKS = 64


class CurvePoint(NamedTuple):
    """The estimated hits of an LRU cache of ``blocks`` blocks."""

    blocks: float
    hit_rate: float  # of the prompt tokens fed
    stderr: float  # its standard error (``ShardsSampler.hit_rate``)
    enough: bool  # whether the sample can answer (``ShardsSampler.answers``): else no figure


def sampling_threshold(rate: float) -> int:
    """The threshold of a sample of ``rate`` (a share in (0, 1]): a block is in it when its
    ``sampling_hash`` is under this. Every sample of blocks or requests by digest uses it."""
    return min(FULL, int(rate * FULL))


def sampling_hash(digest: bytes) -> int:
    """A block's sampling hash: its digest's first 8 bytes, big-endian (uniform, since the
    digest is)."""
    return int.from_bytes(digest[:8], "big")


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
            h = sampling_hash(d)
            if h < threshold:
                out.append((h, i))
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

    def move(self, old: int, new: int, value: int) -> None:
        """The ``value`` at position ``old`` moves to ``new``: both update paths rise until
        they meet, where the two changes cancel (a block referenced again soon walks a few
        nodes)."""
        tree, n = self.tree, self.n
        i, j = old, new
        while i != j:
            if i < j:
                if i > n:
                    return
                tree[i] -= value
                i += i & -i
            else:
                if j > n:
                    return
                tree[j] += value
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
        self.threshold = sampling_threshold(rate)
        self.max_blocks = min(max_blocks, MAX_BLOCKS)
        self.block_size = block_size
        self._last: dict[int, int] = {}  # sampled block's hash -> the time of its last reference
        self._by_hash: list[int] = []  # max-heap (negated) of the sampled blocks' hashes
        self._clock = 0  # references to sampled blocks so far (the time)
        # 1 at each live block's last time; sized to the live sample (4x, at least
        # MIN_TREE), so a small sample's walks stay in the CPU's cache
        self._times = _Fenwick(MIN_TREE)
        # alike, the halves that hold it, packed (``_HALVES``): a 1 in each one's field
        self._halves = _Fenwick(MIN_TREE)
        self._live_halves = 0  # the live blocks' packed halves, summed
        # bucket of scaled distance (``_bucket``) -> summed weight of its references
        self._hist: dict[int, float] = {}
        # ((stratum x GROUPS + group) x COARSE + coarse bucket) -> summed weight
        self._cells = [0.0] * (STRATA * GROUPS * COARSE)
        # first references (compulsory misses), weighted, by stratum x GROUPS + group
        self._cold = [0.0] * (STRATA * GROUPS)
        # (split x SHIFT_BUCKETS + shift bucket of the distance) -> each reference's weight
        # times the relative excess of the split's first half in its distance
        self._shifts = [0.0] * (SPLITS * SHIFT_BUCKETS)
        self._expected = [0] * STRATA  # every block reference fed, by depth stratum
        self.sampled_refs = 0  # references to sampled blocks
        self.sampled_reuses = 0  # ... of which to a block the sample held (not first ones)
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

    @property
    def answers(self) -> bool:
        """Whether the sample holds enough blocks for its estimate and its error to mean what
        they say: at least ``MIN_SAMPLED_BLOCKS``, or every block (rate 1, exact)."""
        return self.sampled_blocks >= MIN_SAMPLED_BLOCKS or self.threshold >= FULL

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
        halves, shifts = self._halves, self._shifts
        live, live_halves = len(last_of), self._live_halves
        for h, depth in hashes:
            if h >= threshold:
                continue
            last = last_of.get(h)
            cell = stratum(depth) * GROUPS + h % GROUPS
            if last is None:
                self._cold[cell] += weight
                continue
            self.sampled_reuses += 1
            # the live blocks referenced since: each has a 1 at its last time, after ``last``
            # (none when no reference came since)
            since = live - times.prefix(last + 1) if self._clock - last - 1 else 0
            bucket = _bucket(since * weight)
            hist[bucket] = hist.get(bucket, 0.0) + weight
            cells[cell * COARSE + _coarse_of(bucket)] += weight
            if since:
                # and how many of them each half holds: the half's relative excess
                part = live_halves - halves.prefix(last + 1)
                step = weight / since
                at = 1 + (bucket - 1) // (_STEPS // SHIFT_STEPS) if bucket else 0
                at = min(SHIFT_BUCKETS - 1, at)
                shifts[at] += step * (2 * (part & MASK) - since)
                shifts[SHIFT_BUCKETS + at] += step * (2 * ((part >> FIELD) & MASK) - since)
                shifts[2 * SHIFT_BUCKETS + at] += step * (2 * (part >> (2 * FIELD)) - since)
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
        times, halves, live = self._times, self._halves, len(self._last)
        if times.prefix(times.n) != live:
            raise AssertionError(f"the tree counts {times.prefix(times.n)} blocks, {live} live")
        if halves.prefix(halves.n) != self._live_halves:
            raise AssertionError("the halves' tree and its total differ")
        for h, t in self._last.items():
            if times.prefix(t + 1) - times.prefix(t) != 1:
                raise AssertionError(f"block {h:#x}: no 1 at its time {t}")
            if halves.prefix(t + 1) - halves.prefix(t) != _HALVES[_split_bits(h)]:
                raise AssertionError(f"block {h:#x}: not in its halves at its time {t}")
            if h >= self.threshold:
                raise AssertionError(f"block {h:#x} is not under the threshold")
        if sorted(-x for x in self._by_hash) != sorted(self._last):
            raise AssertionError("the heap and the live blocks differ")

    def _place(self, h: int, last: int) -> None:
        """``h`` is referenced now (``last``: its time before, -1 when new): its time in the
        trees (renumbered when they are full)."""
        halves = _HALVES[_split_bits(h)]
        if self._clock + 1 > self._times.n:
            if last >= 0:
                self._unplace(h, last)
                del self._last[h]
            self._renumber()
            last = -1
        if last >= 0:
            self._times.move(last + 1, self._clock + 1, 1)
            if halves:
                self._halves.move(last + 1, self._clock + 1, halves)
        else:
            self._times.add(self._clock + 1, 1)
            if halves:
                self._halves.add(self._clock + 1, halves)
            self._live_halves += halves
        self._last[h] = self._clock
        self._clock += 1

    def _unplace(self, h: int, last: int) -> None:
        """``h`` leaves the trees (its time was ``last``)."""
        halves = _HALVES[_split_bits(h)]
        self._times.add(last + 1, -1)
        if halves:
            self._halves.add(last + 1, -halves)
        self._live_halves -= halves

    def _renumber(self) -> None:
        """Give the live blocks consecutive times from 0, in their order, in trees of four
        times their number (the trees are full)."""
        order = sorted(self._last.items(), key=lambda kv: kv[1])
        size = max(MIN_TREE, 4 * len(order))
        self._times, self._halves = _Fenwick(size), _Fenwick(size)
        for i, (h, _) in enumerate(order):
            self._last[h] = i
            self._times.add(i + 1, 1)
            halves = _HALVES[_split_bits(h)]
            if halves:
                self._halves.add(i + 1, halves)
        self._clock = len(order)

    def _drop_largest(self) -> None:
        """The sample is full: the block with the largest hash leaves, the threshold drops."""
        h = -heapq.heappop(self._by_hash)
        self._unplace(h, self._last.pop(h))
        self.threshold = h

    def hit_rate(self, blocks: float) -> CurvePoint:
        """The estimated token hit rate of an LRU prefix cache of ``blocks`` blocks: the share
        of block references that hit (the sampled share, corrected for each depth stratum's
        shortfall or surplus by its groups, weighed by its true references), times the blocks'
        share of the prompt tokens. The standard error adds the groups' jackknife (times the
        finite-sample factor, none at rate 1), the hot corrections' doubt and the distances'
        own error (``_distance_error``), times ``STUDENT``."""
        refs = self.references
        tokens = self.prompt_tokens
        if not tokens or not self.sampled_refs:
            return CurvePoint(blocks, 0.0, 0.0, self.answers)
        unit = FULL / self.threshold  # what a sampled reference counts for now
        fine = self._fine_hits(blocks, unit)
        hits: list[list[float]] = []  # coarse weighted hits, by stratum and group
        seen: list[list[float]] = []  # weighted references the sample saw, alike
        cells, cold = self._cells, self._cold
        reach = 0  # coarse buckets wholly under ``blocks``
        while reach < COARSE and _coarse_top(reach) <= blocks:
            reach += 1
        # the share of the bucket ``blocks`` falls in (log-linear), at most the last
        part = math.log2(blocks) - (reach - 1) if 0 < reach < COARSE else 0.0
        coarse = 0.0
        for s in range(STRATA):
            hit_row, seen_row = [0.0] * GROUPS, [0.0] * GROUPS
            for g in range(GROUPS):
                base = (s * GROUPS + g) * COARSE
                under = sum(cells[base : base + reach])
                h = under + part * cells[base + reach] if reach < COARSE else under
                hit_row[g] = h
                seen_row[g] = cold[s * GROUPS + g] + sum(cells[base : base + COARSE])
                coarse += h
            hits.append(hit_row)
            seen.append(seen_row)
        expected = [float(n) for n in self._expected]
        share, error = stratified_share(hits, seen, expected, unit)
        # the correction, from the coarse counts, added to the fine curve
        share += (fine - coarse) / refs
        scale = refs * self.block_size / tokens  # the blocks' share of the prompt tokens
        keep = math.sqrt(max(0.0, 1.0 - self.rate))  # no sampling error at rate 1
        spread = self._distance_error(blocks) / refs
        stderr = STUDENT * math.sqrt((error * keep) ** 2 + spread * spread) * scale
        return CurvePoint(blocks, min(1.0, max(0.0, share * scale)), stderr, self.answers)

    def _fine_hits(self, blocks: float, unit: float) -> float:
        """The weighted references at a sampled distance ``d`` under ``blocks``, each counted
        ``clip((blocks - d) / unit, 0, 1)`` (``unit``: the blocks one sampled block stands
        for): a bucket of the histogram wholly under ``blocks - unit`` counts whole, the few
        about ``blocks`` by the sampled distances they can hold (multiples of ``unit``)."""
        edge = blocks - unit
        x = blocks / unit
        whole = math.floor(x)
        total = 0.0
        for b, w in self._hist.items():
            top = _bucket_top(b)
            if top <= edge:
                total += w
                continue
            low = _bucket_low(b)
            if low >= blocks:
                continue
            first, last = math.ceil(low / unit), math.ceil(top / unit) - 1
            if last < first:  # taken at a higher rate, between today's multiples
                total += w * min(1.0, max(0.0, (blocks - (low + top) / 2) / unit))
                continue
            full = max(0, min(last, whole - 1) - first + 1)
            tip = x - whole if first <= whole <= last else 0.0
            total += w * (full + tip) / (last - first + 1)
        return total

    def _distance_error(self, blocks: float) -> float:
        """The standard error, in weighted hits, that the sampled distances' own error puts on
        the hits of ``blocks`` blocks: each split's halves disagree by the references about
        ``blocks`` that one half's distances move across it and the other's do not (the shift
        of each distance, log2 of the halves' ratio to first order, over a bucket's width),
        a difference whose square is four times the full sample's variance."""
        if blocks < 1 or self.sampled_reuses == 0:
            return 0.0
        pos = SHIFT_STEPS * math.log2(blocks) + 0.5  # bucket k is centred at k - 0.5
        k = int(pos)
        if k + 1 >= SHIFT_BUCKETS:
            return 0.0
        f = pos - k
        shifts = self._shifts
        total = 0.0
        for j in range(SPLITS):
            base = j * SHIFT_BUCKETS
            excess = (1.0 - f) * shifts[base + k] + f * shifts[base + k + 1]
            moved = excess * SHIFT_STEPS * 2.0 / math.log(2.0)
            total += moved * moved
        rate = self.rate
        variance = total / SPLITS / 4.0 * (1.0 - rate) / (1.0 - rate / 2.0)
        return math.sqrt(max(0.0, variance))


def _split_bits(h: int) -> int:
    """Which halves hold block ``h``: one bit of its hash each, above the group's."""
    return (h >> SPLIT_BITS) & ((1 << SPLITS) - 1)


# by ``_split_bits``: a 1 in the field of each half that holds the block
_HALVES = [
    sum(((bits >> j) & 1) << (FIELD * j) for j in range(SPLITS)) for bits in range(1 << SPLITS)
]


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


def _bucket_low(bucket: int) -> float:
    """The smallest scaled distance of ``bucket``."""
    if bucket == 0:
        return 0.0
    return 2.0 ** ((bucket - 1) / _STEPS)


def _bucket_top(bucket: int) -> float:
    """The smallest cache (blocks) that holds every distance of ``bucket`` (a distance d hits
    a cache of more than d blocks)."""
    if bucket == 0:
        return 1.0
    return 2.0 ** (bucket / _STEPS)
