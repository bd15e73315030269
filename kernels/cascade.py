"""Shared-prefix (cascade) attention plans: which sequences read a common prefix once.

Sequences whose block tables start with the same physical blocks hold the same K/V there (a prefix
cache hands out one copy). Attention over such a prefix is computed once for all queries of the
group, stacked, and merged with each sequence's attention over its own remaining keys by
log-sum-exp. This module only plans: it decides the groups and builds the index tensors.

The grouping rule (``group_shared_prefixes``), a pure function of the tables:

1. Sequence b may share its first ``cached_blocks[b]`` table entries: the full blocks of its
   cached context (``(seq_len - q_len) // block_size``), which every one of its queries sees in
   full, so the prefix pass needs no causal mask.
2. Sequences with at least ``min_blocks`` shareable blocks are bucketed by their first block id.
3. A bucket with at least two sequences is a group; its prefix is the longest common leading run
   of identical block ids over all its members, capped by each member's shareable blocks.
4. Groups whose prefix is shorter than ``min_blocks`` are dropped.

Groups are ordered by their first member, members ascending. A member that diverges early shortens
its whole group's prefix; callers that know better pass explicit groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from prefixcache.errors import KernelInputError


class PrefixGroup(NamedTuple):
    """Sequences (batch indices) whose first ``num_blocks`` table entries are identical."""

    seqs: tuple[int, ...]
    num_blocks: int


class CascadePlan(NamedTuple):
    """Index tensors of one shared-prefix launch (all int32 on the batch's device)."""

    prefix_rows: torch.Tensor  # [num_prefix_rows] packed query rows, stacked group by group
    prefix_row_of: torch.Tensor  # [total_q] row in the prefix pass, -1 for rows without a prefix
    prefix_tables: torch.Tensor  # [G, max prefix blocks] the groups' prefix block ids
    prefix_lens: torch.Tensor  # [G] prefix tokens per group
    prefix_query_start_loc: torch.Tensor  # [G + 1] stacked rows per group
    kv_start: torch.Tensor  # [B] first key of each sequence's own pass (its prefix length)
    max_prefix_len: int
    num_groups: int


def _common_run(tables: Sequence[Sequence[int]], members: Sequence[int], limit: int) -> int:
    first = tables[members[0]]
    n = 0
    while n < limit and all(tables[m][n] == first[n] for m in members[1:]):
        n += 1
    return n


def group_shared_prefixes(
    tables: Sequence[Sequence[int]], cached_blocks: Sequence[int], *, min_blocks: int = 1
) -> list[PrefixGroup]:
    """Prefix groups of a batch by the rule in this module's docstring (pure, no tensors)."""
    if min_blocks < 1:
        raise KernelInputError(f"min_blocks must be >= 1, got {min_blocks}")
    buckets: dict[int, list[int]] = {}
    for b, (row, usable) in enumerate(zip(tables, cached_blocks, strict=True)):
        usable = min(usable, len(row))
        if usable >= min_blocks:
            buckets.setdefault(row[0], []).append(b)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        limit = min(min(cached_blocks[m], len(tables[m])) for m in members)
        run = _common_run(tables, members, limit)
        if run >= min_blocks:
            groups.append(PrefixGroup(tuple(members), run))
    return groups


def find_prefix_groups(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    min_blocks: int = 1,
    block_size: int,
) -> list[PrefixGroup]:
    """``group_shared_prefixes`` of a batch's tensors (reads them on the host: a GPU sync)."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    cached = [(n - (qsl[b + 1] - qsl[b])) // block_size for b, n in enumerate(lens)]
    rows = [row[: max(c, 0)] for row, c in zip(block_tables.tolist(), cached, strict=True)]
    return group_shared_prefixes(rows, cached, min_blocks=min_blocks)


def check_groups(
    groups: Sequence[PrefixGroup],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> None:
    """Explicit groups must be disjoint, in range, and really share cached, identical blocks."""
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    table = block_tables.cpu()
    seen: set[int] = set()
    for i, group in enumerate(groups):
        seqs, num_blocks = group
        if not seqs or num_blocks < 1 or num_blocks > table.shape[1]:
            raise KernelInputError(
                f"shared_prefix group {i} needs >= 1 sequence and 1..{table.shape[1]} blocks, "
                f"got {group}"
            )
        for b in seqs:
            if not 0 <= b < num_seqs or b in seen:
                raise KernelInputError(
                    f"shared_prefix group {i}: sequence {b} is out of range [0, {num_seqs}) or "
                    "already in another group"
                )
            seen.add(b)
            cached = lens[b] - (qsl[b + 1] - qsl[b])
            if num_blocks * block_size > cached:
                raise KernelInputError(
                    f"shared_prefix group {i}: {num_blocks} blocks = {num_blocks * block_size} "
                    f"tokens exceed sequence {b}'s cached context of {cached} tokens"
                )
            if not torch.equal(table[b, :num_blocks], table[seqs[0], :num_blocks]):
                raise KernelInputError(
                    f"shared_prefix group {i}: sequence {b}'s first {num_blocks} block ids differ "
                    f"from sequence {seqs[0]}'s"
                )


def build_plan(
    groups: Sequence[PrefixGroup],
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> CascadePlan:
    """Index tensors for ``groups`` (reads query_start_loc on the host)."""
    device = block_tables.device
    qsl = query_start_loc.tolist()
    total_q = qsl[-1]
    rows: list[int] = []
    group_starts = [0]
    kv_start = [0] * (len(qsl) - 1)
    for seqs, num_blocks in groups:
        for b in seqs:
            rows.extend(range(qsl[b], qsl[b + 1]))
            kv_start[b] = num_blocks * block_size
        group_starts.append(len(rows))
    prefix_row_of = torch.full((total_q,), -1, dtype=torch.int32)
    prefix_row_of[torch.tensor(rows, dtype=torch.long)] = torch.arange(len(rows), dtype=torch.int32)
    max_blocks = max((g.num_blocks for g in groups), default=0)
    leads = torch.tensor([g.seqs[0] for g in groups], dtype=torch.long, device=device)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return CascadePlan(
        prefix_rows=i32(rows),
        prefix_row_of=prefix_row_of.to(device),
        prefix_tables=block_tables.index_select(0, leads)[:, :max_blocks].contiguous(),
        prefix_lens=i32([g.num_blocks * block_size for g in groups]),
        prefix_query_start_loc=i32(group_starts),
        kv_start=i32(kv_start),
        max_prefix_len=max_blocks * block_size,
        num_groups=len(groups),
    )
