"""Planning an admission without changing anything: the cached prefix a prompt reuses, a
partially matching block to copy, the host and store blocks to load, and the new blocks it
needs.

``lookup``, ``can_admit`` and ``admit`` share the plan, so what they report agrees.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import MatchResult, Node, PartialMatch
from prefixcache.errors import RequestTooLargeError
from prefixcache.manager.state import CacheState

_new = tuple.__new__  # a NamedTuple from a tuple in C (its generated __new__ is a Python call)
_NO_BLOCKS: Final[list[bytes]] = []  # shared, never changed: no store run


class AdmissionPlan(NamedTuple):
    """An admission sized without changing anything."""

    need: int  # new blocks to take from the pool
    held_cached: int  # matched blocks nobody holds now (an upper bound when capacity is ample)
    match: MatchResult | None  # None: nothing cached in the namespace (or caching is off)
    shared: int  # leading table blocks shared with the index
    cow: bool  # every prompt block matched: the last one is copied and one token recomputed
    partial: PartialMatch | None  # a block whose leading tokens can be copied
    cached_len: int  # prompt tokens not computed (the copied and loaded ones included)
    host_run: list[bytes]  # digests of the host blocks to load after the matched ones
    host_found: int  # host blocks that continue the match (loaded or recomputed)
    store_run: list[bytes]  # digests of the store blocks to load after the host ones
    store_found: int  # store blocks that continue the match (loaded or recomputed)
    computed: list[bytes] | None  # with a store: digests of the full blocks computed after them


class AdmissionPlanner:
    """Matches prompts against the index and the tiers below it and sizes their admission."""

    __slots__ = ("state",)

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def plan(
        self,
        buf: bytes,
        namespace: Namespace,
        *,
        check_size: bool = True,
        digests: list[bytes] | None = None,
    ) -> AdmissionPlan:
        """Match and size the admission of the prompt ``buf`` (int32 LE tokens; ``digests``: its
        full blocks' digests, when the caller has them).

        With ``check_size``, a prompt larger than the whole pool raises RequestTooLargeError.
        When the pool is too full to keep every matched block held while the new ones are
        taken, the plan counts the matched blocks nobody holds, gives up a partial copy whose
        source would not survive, and gives up copying the last block of a fully cached prompt.
        """
        state = self.state
        p, t = state.block_size, len(buf) // 4
        num_logical = -(-t // p)
        if check_size and num_logical > state.num_blocks:
            raise RequestTooLargeError(
                f"{t} tokens need {num_logical} blocks of {p}, more than the pool's "
                f"{state.num_blocks}; raise num_blocks or split the request"
            )
        index, offload, store = state.index, state.offload, state.store
        root = index.roots.get(namespace)
        if root is None or not state.enable_caching:  # nothing cached in the namespace
            return self._uncached(buf, t, num_logical, namespace)
        match = index.match(root, buf, t // p, digests)
        while True:
            n = match.n
            cow = n > 0 and n * p == t
            shared = n - 1 if cow else n
            need = num_logical - shared
            partial = None
            run: list[bytes] = []
            found = 0
            stored = _NO_BLOCKS
            store_found = 0
            computed: list[bytes] | None = None
            if cow:
                cached_len = t - 1
            else:
                if offload is not None:
                    on_host = offload.find_run(buf, t, match)
                    run, found = on_host.digests, on_host.found
                if store is not None:
                    prev = run[-1] if run else match.digest
                    in_store = store.find_run(buf, t, n + len(run), prev, namespace)
                    stored, store_found, computed = in_store
                cached_len = (n + len(run) + len(stored)) * p
                if state.partial_copy and not run and not stored and cached_len < t - 1:
                    partial = index.partial_match(match, buf, min(p, t - 1 - cached_len))
                    if partial is not None:
                        cached_len += partial.m
            free = state.pool.num_free + index.num_blocks - index.active_blocks
            # the copy source block is held through the admission (our own allocation must not
            # evict it): unheld, it is one evictable block less meanwhile
            source = 1 if partial is not None and partial.node.ref == 0 else 0
            if need <= free - n - source:  # fits even if every matched block were unheld now
                plan = (need, n, match, shared, cow, partial, cached_len, run, found, stored,
                        store_found, computed)  # fmt: skip
                return _new(AdmissionPlan, plan)
            held_cached = _unheld_matched(match)
            if partial is not None and need > free - held_cached - source:
                cached_len -= partial.m  # no room to keep the source: recompute those tokens
                partial = None
            if not cow or need <= free - held_cached:
                plan = (need, held_cached, match, shared, cow, partial, cached_len, run, found,
                        stored, store_found, computed)  # fmt: skip
                return _new(AdmissionPlan, plan)
            # the copy of the last block needs one block more than the prompt: with the pool
            # that full, recompute the last block instead
            match = index.match(root, buf, n - 1, digests)

    def _uncached(
        self, buf: bytes, t: int, num_logical: int, namespace: Namespace
    ) -> AdmissionPlan:
        """The plan of a prompt with nothing cached in its namespace: the store may hold it."""
        state = self.state
        store = state.store
        if store is None or not state.enable_caching:
            return _new(
                AdmissionPlan, (num_logical, 0, None, 0, False, None, 0, [], 0, [], 0, None)
            )
        seed = store.hasher.seed(namespace)
        stored, found, computed = store.find_run(buf, t, 0, seed, namespace)
        cached_len = len(stored) * state.block_size
        none: list[bytes] = []
        plan = (num_logical, 0, None, 0, False, None, cached_len, none, 0, stored, found, computed)
        return _new(AdmissionPlan, plan)


def _unheld_matched(match: MatchResult) -> int:
    """Matched blocks on nodes nobody holds now."""
    unheld = 0
    node: Node | None = match.node
    count = match.j
    while node is not None and node.parent is not None:
        if node.ref == 0:
            unheld += count
        node = node.parent
        count = len(node.blocks)
    return unheld
