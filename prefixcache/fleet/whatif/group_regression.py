"""The hit share of every routed block from a spatial sample's random groups: the estimator the
live curves (``shards``) use.

A spatial sample holds more or fewer block references than its rate promises, and on hot
prefixes by far: one system prompt's few blocks, in the sample or not, carry a large part of
the references and nearly all of them are hits. The plain share ``sum(hits) / sum(refs)`` then
moves by points. SHARDS-adj (Waldspurger et al., FAST'15) counts each missing or surplus
reference as a hit, which is right when hot blocks cause the difference and wrong when it is
chance among cold ones. The sampled blocks are split into random groups (by hash bits the
sampling test does not read), and the groups say which:

- the slope of hits on references across the groups is what each missing or surplus reference
  is worth (near 1 where the groups that drew more references drew hot blocks, near the plain
  share where the draws were alike): a regression estimator from survey sampling;
- a shortfall far beyond what chance gives (the groups' spread says how far chance goes) is
  hot blocks none of which is in the sample; no group shows them, so the slope cannot, and
  each missing reference counts as a hit (SHARDS-adj, where it holds).

The standard error is the delete-a-group jackknife: a hot block's references all fall in its
group, so a sample a few hot blocks dominate shows a wide error, where a binomial error over
references taken one by one would not. To it is added the doubt of the hot correction: a
shortfall between ``CHANCE - 1`` and ``SURE`` standard deviations is either hot blocks the
sample missed or chance in a sample whose heavy blocks (referenced many times) the groups'
spread does not show when none of them is sampled; both happen (a popular document missing at
3-5 deviations, and on the Mooncake trace a deep stratum 5% short at 3.4 deviations whose
missing references were mostly misses), so the missing references are worth anything between
the slope and 1, and half that gap is added as an error, shrinking to none at ``SURE``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

GROUPS = 16  # random groups of sampled blocks
CHANCE = 3.0  # a shortfall of this many standard deviations is past chance
SURE = 6.0  # ... and past this many, surely hot blocks the sample missed
DOUBT = 0.5  # the error of an ambiguous shortfall, as a share of what it could be worth


class GroupShare(NamedTuple):
    """An estimated hit share and its standard error."""

    share: float
    stderr: float


class CorrectedShare(NamedTuple):
    """One stratum's hit share and the doubt of its hot correction (a standard error)."""

    share: float
    doubt: float


def regression_share(
    hits: Sequence[float],
    refs: Sequence[float],
    expected: float,
    unit: float = 1.0,
    prior: float = 0.0,
) -> float:
    """The hit share of all ``expected`` references (the sample's refs if it held exactly what
    the rate promises, in the same units) from each group's sampled ``refs`` and ``hits``;
    ``unit``: what one sampled reference counts for (the inverse of the rate where the refs are
    weighted, 1 where they are counted); ``prior``: the share to assume where the groups hold
    nothing and chance explains it."""
    return corrected_share(hits, refs, expected, unit, prior).share


def corrected_share(
    hits: Sequence[float],
    refs: Sequence[float],
    expected: float,
    unit: float = 1.0,
    prior: float = 0.0,
) -> CorrectedShare:
    """``regression_share`` with the doubt of its hot correction: where the shortfall is
    between ``CHANCE - 1`` and ``SURE`` standard deviations, ``DOUBT`` of what the missing
    references could be worth past the slope (none at ``SURE``)."""
    g = len(refs)
    total = float(sum(refs))
    if expected <= 0 or g == 0:
        return CorrectedShare(0.0, 0.0)
    hit_total = float(sum(hits))
    mean_r, mean_h = total / g, hit_total / g
    spread = sum((r - mean_r) ** 2 for r in refs)
    if spread > 0:
        cov = sum((r - mean_r) * (h - mean_h) for r, h in zip(refs, hits, strict=True))
        slope = cov / spread
    else:
        slope = hit_total / total if total > 0 else prior
    slope = min(1.0, max(0.0, slope))
    shortfall = expected - total
    doubt = 0.0
    if shortfall > 0:
        # how far the shortfall is past chance, in standard deviations of the sampled total:
        # the groups' spread, and at least what references to distinct blocks would give (a
        # Poisson count); past ``CHANCE``, hot blocks the sample missed, and each missing
        # reference counts as a hit; below ``CHANCE - 1``, chance; between, a blend
        by_groups = g * spread / (g - 1) if g > 1 else 0.0
        chance = math.sqrt(max(by_groups, expected * unit))
        z = shortfall / chance
        if CHANCE - 1 <= z < SURE:
            gap = (1.0 - slope) * shortfall / expected
            doubt = DOUBT * min(1.0, (SURE - z) / (SURE - CHANCE)) * gap
        hot = min(1.0, max(0.0, z - (CHANCE - 1)))
        slope += hot * (1.0 - slope)
    share = min(1.0, max(0.0, (hit_total + slope * shortfall) / expected))
    return CorrectedShare(share, doubt)


def stratified_share(
    hits: Sequence[Sequence[float]],
    refs: Sequence[Sequence[float]],
    expected: Sequence[float],
    unit: float = 1.0,
) -> GroupShare:
    """The hit share of every reference over strata (each with its groups' ``hits`` and
    ``refs`` and its true reference count ``expected``; one stratum for an unsplit sample):
    each stratum's ``regression_share`` weighed by its count, with the delete-a-group jackknife
    error of the whole (the same group left out of every stratum at once, the references it
    should hold shrunk alike) and the strata's doubts of their hot corrections, added as
    independent errors. A stratum the sample missed by chance takes the plain share of the
    rest."""
    total = float(sum(expected))
    if total <= 0:
        return GroupShare(0.0, 0.0)
    live = [s for s, n in enumerate(expected) if n > 0]
    seen = sum(sum(r) for r in refs)
    prior = sum(sum(h) for h in hits) / seen if seen > 0 else 0.0

    def combined(skip: int) -> CorrectedShare:
        out = doubt = 0.0
        for s in live:
            h, r, n = hits[s], refs[s], expected[s]
            if skip >= 0:
                h, r = [*h[:skip], *h[skip + 1 :]], [*r[:skip], *r[skip + 1 :]]
                part = n * (len(refs[s]) - 1) / len(refs[s])
            else:
                part = n
            one = corrected_share(h, r, part, unit, prior)
            out += one.share * n
            doubt += (one.doubt * n) ** 2
        return CorrectedShare(out / total, math.sqrt(doubt) / total)

    estimate, doubt = combined(-1)
    g = min((len(refs[s]) for s in live), default=0)
    if g < 2:
        return GroupShare(estimate, doubt)
    rest = [combined(i).share for i in range(g)]
    mean = sum(rest) / g
    jackknife = (g - 1) / g * sum((x - mean) ** 2 for x in rest)
    return GroupShare(estimate, math.sqrt(jackknife + doubt * doubt))
