"""The live curves' standard error against the truth, over sample seeds: on a fixed chat
workload (a 32-block system prompt every request starts with, then conversations that resend
their history), 20 seeds (each a different hashing of the same prompts, so a different sample)
at 1% and at 10%, the exact LRU's hit rate is within 2 standard errors of the estimate at 90%
or more of the points, and the error is neither far below nor far above the estimate's real
spread. Deterministic: fixed prompts and seeds, nothing timed."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
import xxhash

from prefixcache.fleet.whatif.shards import ShardsSampler

B = 16
SEEDS = 20
FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8)  # cache sizes, as shares of the distinct blocks


@cache
def _chat(requests: int = 8000, system: int = 32) -> tuple[list[list[int]], list[int]]:
    """Block ids of each prompt, root first, and its length in tokens: every conversation
    starts with the same ``system`` blocks; about 300 are open at a time, each of 1-12 turns,
    a turn adding 20-150 tokens to the history it resends."""
    rng = np.random.default_rng(11)
    fresh = system
    open_: list[tuple[list[int], int, int]] = []
    prompts, lengths = [], []
    for _ in range(requests):
        if len(open_) < 300:
            open_.append((list(range(system)), 0, int(rng.integers(1, 13))))
        i = int(rng.integers(len(open_)))
        ids, partial, turns = open_[i]
        tokens = partial + int(rng.integers(20, 150))
        ids = ids + list(range(fresh, fresh + tokens // B))
        fresh += tokens // B
        prompts.append(ids)
        lengths.append(len(ids) * B + tokens % B)
        if turns == 1:
            open_.pop(i)
        else:
            open_[i] = (ids, tokens % B, turns - 1)
    return prompts, lengths


def _exact(prompts: list[list[int]], lengths: list[int], sizes: list[int]) -> list[float]:
    """The token hit rate of an exact LRU of each size, from every reference's reuse distance
    (distinct blocks referenced since, measured as the prompt finds the cache; its blocks then
    referenced deepest first), in one pass."""
    n = sum(len(p) for p in prompts) + 1
    tree = [0] * (n + 1)  # a 1 at each live block's last time

    def add(i: int, d: int) -> None:
        while i <= n:
            tree[i] += d
            i += i & -i

    def prefix(i: int) -> int:
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    hits = [0] * len(sizes)
    clock = 0
    for ids in prompts:
        for block in ids:
            t = last.get(block)
            if t is not None:
                since = len(last) - prefix(t + 1)
                for k, size in enumerate(sizes):
                    hits[k] += since < size
        for block in reversed(ids):
            t = last.get(block)
            if t is not None:
                add(t + 1, -1)
            add(clock + 1, 1)
            last[block] = clock
            clock += 1
    return [h * B / sum(lengths) for h in hits]


@cache
def _truth() -> tuple[list[int], list[float]]:
    prompts, lengths = _chat()
    distinct = len({b for p in prompts for b in p})
    sizes = [int(distinct * f) for f in FRACTIONS]
    return sizes, _exact(prompts, lengths, sizes)


def _points(rate: float, seed: int) -> list[tuple[float, float]]:
    """(estimate minus truth, stderr) at each size, for the sample that ``seed`` hashes."""
    prompts, lengths = _chat()
    sizes, exact = _truth()
    salt = b"%d:" % seed
    sample = ShardsSampler(rate=rate, max_blocks=1 << 20, block_size=B)
    for ids, n in zip(prompts, lengths, strict=True):
        sample.reference_prompt([xxhash.xxh3_128_digest(salt + b"%d" % i) for i in ids], n)
    out = []
    for size, truth in zip(sizes, exact, strict=True):
        point = sample.hit_rate(size)
        out.append((point.hit_rate - truth, point.stderr))
    return out


@pytest.mark.parametrize("rate", [0.01, 0.1])
def test_the_truth_is_within_two_standard_errors_at_nine_points_in_ten(rate):
    points = [p for seed in range(SEEDS) for p in _points(rate, seed)]
    inside = sum(abs(error) <= 2 * stderr for error, stderr in points)
    assert inside >= 0.9 * len(points), f"{inside} of {len(points)} within 2 stderr"
    # nor wide for safety: the errors' spread and the typical standard error agree within 2x
    spread = math.sqrt(sum(e * e for e, _ in points) / len(points))
    typical = float(np.median([s for _, s in points]))
    assert 0.5 < typical / spread < 2, (typical, spread)
