"""What the manager hands back to a runtime: admissions, appends, copies, lookups."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Copy(NamedTuple):
    """Copy slots ``0 .. num_slots-1`` of block ``src`` into block ``dst`` (K and V).

    When to run it: in each layer, after that layer's K/V store of the step that produced the
    copy and before its attention (``PagedKVCache.apply_copies(copies, layer)``). The copied
    slots never overlap the slots the step writes, and ``src`` may be a block whose K/V is
    written in that same step (indexed by an earlier admission of the step). The source stays
    protected from eviction until ``end_step()`` (``stepped=True``), else until the request's
    next ``append`` or its ``release``. The copies of a request aborted before the forward pass
    must not run: its ``dst`` may be handed out again at once.
    """

    src: int
    dst: int
    num_slots: int


class Lookup(NamedTuple):
    """What an admission of a prompt would reuse now (``CacheManager.lookup``)."""

    cached_len: int  # tokens a new request would not compute
    cached_blocks: int  # full blocks found in the index
    host_blocks: int = 0  # full blocks after them that would be loaded from the host tier


_SHORT_RUN = 64  # up to this many slots, a list is cheaper to build than numpy's index arithmetic


def slots_of(table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Slot ids (block * block_size + offset) of positions ``start .. end-1``."""
    if end - start <= _SHORT_RUN:  # a decode step's few tokens: numpy's per-call cost dominates
        return np.array(
            [table[t // block_size] * block_size + t % block_size for t in range(start, end)],
            dtype=np.int64,
        )
    first = start // block_size
    blocks = np.asarray(table[first : -(-end // block_size)], dtype=np.int64)
    pos = np.arange(start, end, dtype=np.int64)
    return blocks[pos // block_size - first] * block_size + pos % block_size


class Admission(NamedTuple):
    """An admitted prompt's block table, what of it is cached, and the copies to run."""

    cached_len: int  # leading prompt tokens whose K/V are already in place
    block_table: list[int]  # physical block of each logical block of the prompt
    copies: list[Copy]  # copy-on-write / partially matched block: see Copy for when to run
    num_tokens: int
    block_size: int
    hit_blocks: int = 0  # full blocks matched in the index
    partial_tokens: int = 0  # tokens of a partially matching block copied instead of computed
    cow: bool = False  # every prompt block was cached: the last one is copied, one token computed
    host_blocks: int = 0  # full blocks loaded from the host tier (after the ``hit_blocks``)

    def slot_mapping(self) -> np.ndarray:
        """int64 slots of the tokens to compute, ``tokens[cached_len:]``."""
        return slots_of(self.block_table, self.block_size, self.cached_len, self.num_tokens)


class AppendResult(NamedTuple):
    """Where appended tokens' K/V go, and the copy to run before writing them."""

    slots: np.ndarray  # int64 slot of each appended token
    copies: list[Copy]
