"""Shared-prefix (cascade) attention: a prefix read once per group, merged by log-sum-exp.

Exactness is checked against attention over each sequence's contiguous K/V (fp32 1e-5, fp16 3e-3,
as in test_kernels.py). Caches are NaN outside owned slots, so a pass that reads past its keys
shows up as NaN.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.kernels import (
    KernelInputError,
    PrefixGroup,
    group_shared_prefixes,
    interpreter_enabled,
    paged_attention,
    plan_shared_prefix,
)
from prefixcache.kernels.cascade import find_prefix_groups
from prefixcache.kernels.testing import RandomBatch, contiguous_attention, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _batch(
    seq_lens: list[int],
    q_lens: list[int],
    share_from: list[tuple[int, int] | None],
    *,
    heads: tuple[int, int] = (4, 2),
    dtype: torch.dtype = torch.float32,
    block_size: int = 8,
    seed: int = 0,
) -> RandomBatch:
    return make_paged_batch(
        seq_lens,
        q_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        share_from=share_from,
        seed=seed,
    )


def _attend(b: RandomBatch, **kw: Any) -> torch.Tensor:
    return paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, **kw
    )


def _check(b: RandomBatch, out: torch.Tensor) -> None:
    tol = TOL[b.q.dtype]
    assert not out.isnan().any(), "NaN in output: a pass read an unowned slot"
    torch.testing.assert_close(out.float(), contiguous_attention(b).float(), atol=tol, rtol=tol)


# (seq_lens, q_lens, share_from, expected auto groups); block size 8.
CASES = [
    # one group of 4: decodes and extends mixed, prefix of 3 blocks
    (
        [30, 27, 40, 25],
        [1, 3, 1, 1],
        [None, (0, 3), (0, 3), (0, 3)],
        [PrefixGroup((0, 1, 2, 3), 3)],
    ),
    # prefix ending mid-table; sequence 2 shares nothing; two separate groups
    (
        [33, 20, 17, 41, 35],
        [1, 2, 1, 9, 1],
        [None, (0, 2), None, None, (3, 4)],
        [PrefixGroup((0, 1), 2), PrefixGroup((3, 4), 4)],
    ),
    # nested sharing: the group's prefix is the run common to all (1 block), not the longer pair
    (
        [40, 40, 26],
        [1, 1, 2],
        [None, (0, 4), (0, 1)],
        [PrefixGroup((0, 1, 2), 1)],
    ),
]


@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "share", "groups"), CASES, ids=["g4", "g2g2", "nest"]
)
def test_auto_groups_match_reference(
    seq_lens: list[int], q_lens: list[int], share: list, groups: list[PrefixGroup]
) -> None:
    b = _batch(seq_lens, q_lens, share, seed=len(seq_lens))
    found = find_prefix_groups(b.block_tables, b.seq_lens, b.query_start_loc, block_size=8)
    assert found == groups
    _check(b, _attend(b, shared_prefix="auto"))


def test_explicit_groups_including_a_group_of_one() -> None:
    """A single-member group and a group over fewer blocks than the tables share."""
    b = _batch([33, 30, 21, 19], [1, 4, 2, 1], [None, (0, 3), None, (2, 2)], seed=3)
    groups = [PrefixGroup((0, 1), 2), PrefixGroup((2,), 1), PrefixGroup((3,), 2)]
    _check(b, _attend(b, shared_prefix=groups))


@pytest.mark.parametrize(
    ("heads", "dtype", "kw"),
    [
        ((8, 2), torch.float16, {}),
        ((4, 1), torch.float32, {"num_splits": 4}),
        ((2, 2), torch.float16, {"num_splits": 2}),
    ],
    ids=["gqa-fp16", "mqa-split4", "mha-fp16-split2"],
)
def test_cascade_gqa_dtypes_and_splits(
    heads: tuple[int, int], dtype: torch.dtype, kw: dict
) -> None:
    b = _batch(
        [57, 50, 49, 9],
        [1, 5, 1, 1],
        [None, (0, 6), (0, 6), None],
        heads=heads,
        dtype=dtype,
        seed=heads[0],
    )
    _check(b, _attend(b, shared_prefix="auto", **kw))


def test_cascade_returns_the_merged_lse() -> None:
    b = _batch([30, 27, 12], [1, 3, 2], [None, (0, 3), None], seed=5)
    lse = torch.empty(b.q.shape[:2], device=b.q.device)
    expected = torch.empty_like(lse)
    out = _attend(b, shared_prefix="auto", lse=lse)
    _attend(b, lse=expected, backend="torch")
    _check(b, out)
    torch.testing.assert_close(lse, expected, atol=1e-5, rtol=1e-5)


def test_no_shared_blocks_and_torch_backend_agree() -> None:
    """No group found: the plain path; the torch backend accepts shared_prefix too."""
    b = _batch([20, 9], [2, 1], [None, None], seed=7)
    assert find_prefix_groups(b.block_tables, b.seq_lens, b.query_start_loc, block_size=8) == []
    _check(b, _attend(b, shared_prefix="auto"))
    _check(b, _attend(b, shared_prefix="auto", backend="torch"))


def test_prefix_of_new_tokens_is_not_shared() -> None:
    """Shared blocks holding a sequence's own new tokens stay in its causal pass."""
    b = _batch([16, 16], [9, 1], [None, (0, 2)], seed=9)
    # sequence 0 has 7 cached tokens: no full cached block, so it cannot join.
    assert find_prefix_groups(b.block_tables, b.seq_lens, b.query_start_loc, block_size=8) == []
    _check(b, _attend(b, shared_prefix=[PrefixGroup((1,), 1)]))


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([PrefixGroup((0, 1), 3)], "differ"),
        ([PrefixGroup((0, 1), 5)], "exceed"),
        ([PrefixGroup((0,), 1), PrefixGroup((0,), 1)], "another group"),
        ([PrefixGroup((7,), 1)], "out of range"),
        ([PrefixGroup((0,), 0)], "needs >= 1"),
    ],
    ids=["ids-differ", "past-cached", "twice", "range", "empty"],
)
def test_bad_explicit_groups(groups: list[PrefixGroup], match: str) -> None:
    b = _batch([40, 33], [1, 1], [None, (0, 2)], seed=2)
    with pytest.raises(KernelInputError, match=match):
        _attend(b, shared_prefix=groups, backend="torch")


def test_bad_shared_prefix_mode() -> None:
    b = _batch([9], [1], [None])
    with pytest.raises(KernelInputError, match="shared_prefix"):
        _attend(b, shared_prefix="always")


@st.composite
def _tables(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Tables drawn from a few shared stems so that runs of identical ids are common."""
    n = draw(st.integers(1, 8))
    stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1))
    tables, cached = [], []
    for _ in range(n):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, 9), max_size=3))
        row = stem[:cut] + tail
        tables.append(row)
        cached.append(draw(st.integers(0, len(row) + 1)))
    return tables, cached


def _common(rows: list[list[int]], limit: int) -> int:
    n = 0
    while n < limit and all(r[n] == rows[0][n] for r in rows):
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(_tables(), st.integers(1, 3))
def test_grouping_rule(data: tuple[list[list[int]], list[int]], min_blocks: int) -> None:
    tables, cached = data
    groups = group_shared_prefixes(tables, cached, min_blocks=min_blocks)
    usable = [min(c, len(t)) for t, c in zip(tables, cached, strict=True)]
    members = [b for g in groups for b in g.seqs]
    assert len(members) == len(set(members)), "a sequence is in two groups"
    for seqs, num_blocks in groups:
        assert len(seqs) >= 2 and list(seqs) == sorted(seqs)
        assert min_blocks <= num_blocks <= min(usable[b] for b in seqs)
        rows = [tables[b] for b in seqs]
        # exactly the longest common leading run, capped by what every member may share
        assert num_blocks == _common(rows, min(usable[b] for b in seqs))
    # every eligible pair with the same first block is grouped together, or their run is too short
    for a in range(len(tables)):
        for b in range(a + 1, len(tables)):
            if usable[a] >= min_blocks and usable[b] >= min_blocks and tables[a][0] == tables[b][0]:
                same = [g for g in groups if a in g.seqs and b in g.seqs]
                if not same:
                    bucket = [
                        s
                        for s in range(len(tables))
                        if usable[s] >= min_blocks and tables[s][0] == tables[a][0]
                    ]
                    limit = min(usable[s] for s in bucket)
                    assert _common([tables[s] for s in bucket], limit) < min_blocks
    assert group_shared_prefixes(tables, cached, min_blocks=min_blocks) == groups  # pure


def test_a_plan_runs_without_planning_again() -> None:
    """plan_shared_prefix once, then shared_prefix=plan: the same output as planning each call."""
    b = _batch([30, 27, 12], [1, 1, 1], [None, (0, 3), None], seed=11)
    plan = plan_shared_prefix(b.block_tables, b.seq_lens, b.query_start_loc, block_size=8)
    assert plan is not None and plan.num_groups == 1 and plan.max_prefix_len == 24
    out = _attend(b, shared_prefix=plan, validate=False)
    _check(b, out)
    torch.testing.assert_close(out, _attend(b, shared_prefix="auto"), atol=0, rtol=0)
    assert (
        plan_shared_prefix(b.block_tables, b.seq_lens, b.query_start_loc, block_size=8, groups=[])
        is None
    )


def test_a_plan_for_another_batch_is_refused() -> None:
    b = _batch([30, 27, 12], [1, 1, 1], [None, (0, 3), None], seed=11)
    other = _batch([30, 27], [1, 1], [None, (0, 3)], seed=11)
    plan = plan_shared_prefix(
        other.block_tables, other.seq_lens, other.query_start_loc, block_size=8
    )
    with pytest.raises(KernelInputError, match="another batch"):
        _attend(b, shared_prefix=plan)
