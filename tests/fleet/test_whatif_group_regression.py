"""The live curves' estimator: a sample short of (or over) what
its rate promises is corrected by what its random groups show; a shortfall far past chance is
hot blocks the sample missed, counted as hits; a stratum the sample missed by chance takes the
others' share; the jackknife error widens where a few groups carry the hits."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from prefixcache.fleet.whatif.group_regression import (
    GROUPS,
    regression_share,
    stratified_share,
)


def group_share(hits: list[float], refs: list[float], expected: float):
    """One stratum: the sample unsplit by depth."""
    return stratified_share([hits], [refs], [expected])


def test_the_error_widens_when_a_few_groups_carry_the_hits():
    blocks = [100.0] * GROUPS
    share, error = group_share([50.0] * GROUPS, blocks, 100.0 * GROUPS)
    assert (share, error) == (0.5, 0.0)  # every group alike: the share is sure
    hot = [0.0] * GROUPS
    hot[3] = 50.0 * GROUPS  # the same share, all of it in one group's blocks
    assert group_share(hot, blocks, 100.0 * GROUPS).stderr > 0.1
    rng = np.random.default_rng(0)
    spread = rng.binomial(100, 0.5, GROUPS).astype(float).tolist()
    # hits spread over every group: near the binomial error of 1,600 blocks at one half
    assert 0.3 * 0.0125 < group_share(spread, blocks, 100.0 * GROUPS).stderr < 3 * 0.0125


def test_a_sample_short_of_its_hot_blocks_is_corrected_by_what_the_groups_show():
    # 16 groups of 100 cold blocks, a tenth of them hits; one group also drew 40 blocks of a
    # hot prefix (all hits) where the rate promised 80: the groups that drew more blocks drew
    # hits, so each missing block counts as one
    blocks = [100.0] * GROUPS
    hits = [10.0] * GROUPS
    blocks[5] += 40
    hits[5] += 40
    expected = 100.0 * GROUPS + 80
    plain = sum(hits) / sum(blocks)
    assert regression_share(hits, blocks, expected) == pytest.approx((sum(hits) + 40) / expected)
    assert regression_share(hits, blocks, expected) > plain + 0.02
    # the same shortfall among cold blocks alone (groups alike, within chance): the plain
    # share stands
    even = [95.0] * GROUPS
    assert regression_share([19.0] * GROUPS, even, 100.0 * GROUPS) == pytest.approx(0.2)
    assert regression_share([0.0] * GROUPS, [0.0] * GROUPS, 0.0) == 0.0  # nothing due


def test_a_shortfall_far_past_chance_counts_the_missing_references_as_hits():
    # a system prompt's references (a fifth of all) in no group: the groups hold 1,600 cold
    # references a tenth of which hit, the rate promised 2,000; chance gives at most
    # sqrt(2,000) = 45 of shortfall, 400 is hot blocks the sample missed (SHARDS-adj holds)
    rng = np.random.default_rng(1)
    refs = (100 + rng.integers(-5, 6, GROUPS)).astype(float).tolist()
    hits = [r / 10 for r in refs]
    truth = (sum(hits) + 2000 - sum(refs)) / 2000
    assert regression_share(hits, refs, 2000.0) == pytest.approx(truth)
    # the slope alone (before) gave the cold share to the missing references too
    assert regression_share(hits, refs, 2000.0) > 0.25
    # a shortfall within chance keeps the slope: 30 references short of 1,630
    assert regression_share(hits, refs, sum(refs) + 30) == pytest.approx(
        (sum(hits) + 3) / (sum(refs) + 30), abs=1e-9
    )
    # between the two, a blend: the estimate moves with the shortfall, never jumps
    due = [sum(refs) + math.sqrt(sum(refs)) * z for z in np.linspace(0.5, 5, 40)]
    shares = [regression_share(hits, refs, d) for d in due]
    assert all(abs(b - a) < 0.02 for a, b in itertools.pairwise(shares))


def test_a_weighted_sample_measures_chance_in_references_of_its_rate():
    # at 1% each sampled reference counts for 100: a shortfall of 3,000 in 200,000 is under
    # two Poisson deviations (sqrt(200,000 x 100) = 4,472), chance, not hot blocks
    refs = [12_500.0] * GROUPS
    hits = [1_250.0] * GROUPS
    assert regression_share(hits, refs, 203_000.0, unit=100.0) == pytest.approx(0.1)
    assert regression_share(hits, refs, 203_000.0, unit=1.0) > 0.1  # counted as hot at unit 1


def test_strata_weigh_by_their_true_counts_and_a_missed_one_takes_the_rest():
    # stratum 0: one hot block (every reference a hit), 4,000 references, none sampled; with
    # a rate of 1% its 40 due references are far past chance: all hits. Stratum 1: cold,
    # sampled as promised. Stratum 2: 200 references, 2 due: missed by chance, the others'
    # plain share
    unit = 100.0
    zero = [0.0] * GROUPS
    cold_refs = [unit * 10] * GROUPS  # 160 sampled, 16,000 references
    cold_hits = [unit * 2] * GROUPS
    share, error = stratified_share(
        [zero, cold_hits, zero], [zero, cold_refs, zero], [4_000.0, 16_000.0, 200.0], unit
    )
    assert share == pytest.approx((4_000 + 0.2 * 16_000 + 0.2 * 200) / 20_200)
    assert error == pytest.approx(0.0, abs=1e-12)  # every group alike
    assert stratified_share([], [], [], unit) == (0.0, 0.0)
