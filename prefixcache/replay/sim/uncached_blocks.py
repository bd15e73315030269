"""The block counts of a paged cache that caches nothing: the no-cache pass of a serving replay.

A ``CacheManager`` built with ``enable_caching=False`` never indexes a block, so all it decides
is whether the blocks a call needs are free: an admission takes one block per prompt block, a
fork shares every block of its parent, an append takes the blocks its tokens spill into (plus a
copy of the last block while a fork still shares it), and a release frees the blocks nobody
shares any more. ``UncachedBlocks`` keeps those counts and nothing else (no tokens, no block ids),
answering exactly as that manager does, in constant time per call. The serving simulation's
no-cache pass needs nothing more from its cache, and the equality tests replay it against the
real manager.
"""

from __future__ import annotations

from collections.abc import Hashable

from prefixcache.errors import OutOfBlocksError, RequestTooLargeError


class SharedRun:
    """Blocks that several sequences hold together (a prompt's, after forks)."""

    __slots__ = ("blocks", "holders")

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.holders = 1


class CountedSequence:
    """What one sequence holds: its prompt's full blocks, the prompt's partial last block (until
    a write copies it away from the forks that share it), and blocks of its own."""

    __slots__ = ("full", "num_tokens", "own", "prompt_blocks", "tail")

    def __init__(self, num_tokens: int, full: SharedRun, tail: SharedRun | None) -> None:
        self.num_tokens = num_tokens
        self.full = full
        self.tail = tail
        self.prompt_blocks = full.blocks + (1 if tail is not None else 0)
        self.own = 0  # blocks appended (or copied) into, held by this sequence alone


class UncachedBlocks:
    """Free-block accounting of ``CacheManager(num_blocks, block_size, enable_caching=False)``
    for the calls a serving simulation makes: admit, fork, append, release."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self.seqs: dict[Hashable, CountedSequence] = {}
        self.deficit = 0  # blocks the last refused admission lacked

    def admit(self, request_id: Hashable, num_tokens: int) -> None:
        """Take a prompt's blocks (RequestTooLargeError when it needs more than the whole pool,
        OutOfBlocksError when not enough are free; nothing changes then)."""
        p = self.block_size
        need = -(-num_tokens // p)
        if need > self.num_blocks:
            raise RequestTooLargeError(
                f"{num_tokens} tokens need {need} blocks of {p}, more than the pool's "
                f"{self.num_blocks}"
            )
        if need > self.free:
            self.deficit = need - self.free
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} new blocks but only {self.free} are free",
                needed=need,
                available=self.free,
            )
        self.free -= need
        full = SharedRun(num_tokens // p)
        tail = SharedRun(1) if num_tokens % p else None
        self.seqs[request_id] = CountedSequence(num_tokens, full, tail)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` sharing every block of ``parent_id`` (which has appended nothing:
        a serving simulation forks right after the prefill)."""
        parent = self.seqs[parent_id]
        assert parent.own == 0, "forks share the prompt's blocks only"
        child = CountedSequence(parent.num_tokens, parent.full, parent.tail)
        child.prompt_blocks = parent.prompt_blocks
        parent.full.holders += 1
        if parent.tail is not None:
            parent.tail.holders += 1
        self.seqs[child_id] = child

    def append(self, request_id: Hashable, num_tokens: int) -> bool:
        """Append ``num_tokens`` tokens; False, changing nothing, when the blocks they need are
        not free."""
        seq = self.seqs[request_id]
        p = self.block_size
        t0 = seq.num_tokens
        t1 = t0 + num_tokens
        need = -(-t1 // p) - seq.prompt_blocks - seq.own
        tail = seq.tail
        copy = seq.own == 0 and tail is not None and tail.holders > 1 and t0 % p != 0
        if copy:
            need += 1
        if need > self.free:
            return False
        self.free -= need
        if copy:  # the shared last block is copied into one of ours first
            assert tail is not None
            tail.holders -= 1
            seq.tail = None
            seq.prompt_blocks -= 1
        seq.own += need
        seq.num_tokens = t1
        return True

    def release(self, request_id: Hashable) -> None:
        """Give back a sequence's blocks: its own ones, and the shared ones nobody else holds."""
        seq = self.seqs.pop(request_id)
        freed = seq.own
        full = seq.full
        full.holders -= 1
        if not full.holders:
            freed += full.blocks
        tail = seq.tail
        if tail is not None:
            tail.holders -= 1
            if not tail.holders:
                freed += 1
        self.free += freed

    def active_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.free
