"""Random paged batches for tests and benchmarks, with traps for out-of-bounds reads.

Every cache slot that no sequence owns holds NaN, and block 0 is reserved all-NaN and used as the
block-table padding, so any load the kernel fails to mask shows up as NaN in its output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.kernels.batch import PagedBatch
from prefixcache.kernels.reference import reference_attention

NAN_BLOCK = 0


class RandomBatch(PagedBatch):
    """A random ``PagedBatch`` whose K/V are also held contiguously per sequence (the truth)."""

    keys: list[torch.Tensor]  # B x [seq_len, Hkv, D] contiguous truth
    values: list[torch.Tensor]  # B x [seq_len, Hkv, D]

    def slot_mapping(self, b: int) -> torch.Tensor:
        """int64 [seq_len] slots of sequence b's tokens."""
        block_size = self.k_cache.shape[1]
        pos = torch.arange(int(self.seq_lens[b]), device=self.block_tables.device)  # [seq_len]
        blocks = self.block_tables[b, pos // block_size].long()  # [seq_len]
        return blocks * block_size + pos % block_size


def make_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shared_prefix_blocks: int = 0,
    share_from: Sequence[tuple[int, int] | None] | None = None,
    spare_blocks: int = 3,
    pad_id: int = NAN_BLOCK,
    seed: int = 0,
) -> RandomBatch:
    """Build a batch: sequence b has ``seq_lens[b]`` tokens of which the last ``q_lens[b]`` query.

    Physical block ids are shuffled; the first ``shared_prefix_blocks`` blocks of every sequence
    are the same physical blocks (same K/V), as a prefix cache would hand them out.
    ``share_from[b] = (donor, n)`` (donor < b) makes sequence b's first n blocks those of sequence
    ``donor`` instead (after the common shared blocks' rule), for partial and nested sharing.
    Unused table entries hold ``pad_id`` (the NaN block by default, or e.g. -1).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    shared = shared_prefix_blocks
    if any(n < shared for n in blocks_per_seq):
        raise ValueError("every sequence needs at least shared_prefix_blocks blocks")
    share = list(share_from) if share_from is not None else [None] * len(seq_lens)
    if shared and any(share):
        raise ValueError("pass either shared_prefix_blocks or share_from")
    borrowed = [s[1] if s else shared for s in share]
    for b, s in enumerate(share):
        full = min(seq_lens[b], seq_lens[s[0]]) // block_size if s else 0  # whole blocks only
        if s and not (0 <= s[0] < b and s[1] <= full):
            raise ValueError(
                f"share_from[{b}] = {s} needs an earlier donor, and both sequences must fill "
                f"the {s[1]} shared blocks"
            )
    num_private = sum(n - k for n, k in zip(blocks_per_seq, borrowed, strict=True))
    num_blocks = 1 + shared + num_private + spare_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays NaN
    shared_ids, private_ids = ids[:shared], iter(ids[shared:])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(kv_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(kv_shape, float("nan"), dtype=dtype)
    prefix_len = shared * block_size
    prefix_k, prefix_v = (randn(prefix_len, num_kv_heads, head_dim) for _ in range(2))
    table = torch.full((len(seq_lens), max(blocks_per_seq, default=1) + 1), pad_id)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    rows: list[list[int]] = []
    for b, n in enumerate(seq_lens):
        if share[b]:
            donor, n_blocks = share[b]  # type: ignore[misc]
            head_k = keys[donor][: n_blocks * block_size].cpu()
            head_v = values[donor][: n_blocks * block_size].cpu()
            head_ids = rows[donor][:n_blocks]
        else:
            head_k, head_v, head_ids, n_blocks = prefix_k, prefix_v, shared_ids, shared
        k = torch.cat([head_k, randn(n - len(head_k), num_kv_heads, head_dim)])
        v = torch.cat([head_v, randn(n - len(head_v), num_kv_heads, head_dim)])
        row = head_ids + [next(private_ids) for _ in range(blocks_per_seq[b] - n_blocks)]
        rows.append(row)
        table[b, : len(row)] = torch.tensor(row, dtype=table.dtype)
        pos = torch.arange(n)
        blocks = table[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        keys.append(k.to(device))
        values.append(v.to(device))
    starts = torch.tensor([0, *q_lens]).cumsum(0)  # [B + 1]
    batch = RandomBatch(
        q=randn(int(starts[-1]), num_q_heads, head_dim).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=table.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=starts.to(device=device, dtype=torch.int32),
    )
    batch.keys, batch.values = keys, values
    return batch


def contiguous_attention(batch: RandomBatch, scale: float | None = None) -> torch.Tensor:
    """Truth for ``batch``: ``reference_attention`` over each sequence's contiguous K/V."""
    out = torch.empty_like(batch.q)
    starts = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        lo, hi = starts[b], starts[b + 1]
        out[lo:hi] = reference_attention(batch.q[lo:hi], k, v, causal=True, scale=scale)
    return out
