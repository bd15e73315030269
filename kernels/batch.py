"""The paged batch: the six tensors of one paged attention call, declared once.

``paged_attention`` gathers its tensor arguments into a ``PagedBatch``; the argument checks
(``validation``), the torch reference and the Triton launches take it whole.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedBatch(NamedTuple):
    """New query tokens of a batch of sequences, packed, and the paged K/V they attend to.

    Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``, the last q_len of its
    ``seq_lens[b]`` tokens, whose K/V sit in the blocks listed by ``block_tables[b]``. Unpacks in
    ``paged_attention``'s argument order: ``paged_attention(*batch, ...)``.
    """

    q: torch.Tensor  # [total_q, Hq, D] new query tokens of all sequences, packed
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32 block ids
    seq_lens: torch.Tensor  # [B] int32 cached + new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32 first query row of each sequence
