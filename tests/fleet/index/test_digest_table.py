"""The digest table against a dict: every lookup, assignment, deletion and remap, through growth
and rebuilds; and the compact fleet index on it costs at most 64 bytes per (block, replica)."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixcache.fleet.index.compact import CompactFleetIndex
from prefixcache.fleet.index.digest_table import DigestTable, digest_keys, key_bytes

# few distinct low halves, so keys share home buckets and chains run across full buckets
_POOL = [bytes([k % 5]) * 8 + bytes([k]) * 8 for k in range(200)]


class TableAgainstDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = DigestTable()
        self.model: dict[bytes, int] = {}

    @rule(
        picks=st.lists(st.sampled_from(_POOL), min_size=1, max_size=40, unique=True),
        values=st.lists(st.integers(0, 9), min_size=40, max_size=40),
    )
    def assign(self, picks: list[bytes], values: list[int]) -> None:
        keys = digest_keys(picks)
        slots, _ = self.table.lookup(keys)
        self.table.assign(keys, slots, np.array(values[: len(picks)]))
        for d, v in zip(picks, values, strict=False):
            if v:
                self.model[d] = v
            else:
                self.model.pop(d, None)

    @rule(
        picks=st.lists(st.sampled_from(_POOL), min_size=1, max_size=24, unique=True),
        values=st.lists(st.integers(0, 9), min_size=24, max_size=24),
    )
    def assign_digests(self, picks: list[bytes], values: list[int]) -> None:
        """The digest-level calls: a few digests walked in Python, more vectorised."""
        slots, current = self.table.lookup_digests(picks)
        assert current == [self.model.get(d, 0) for d in picks]
        self.table.assign_digests(picks, slots, values[: len(picks)])
        for d, v in zip(picks, values, strict=False):
            if v:
                self.model[d] = v
            else:
                self.model.pop(d, None)

    @rule(drop=st.integers(1, 9), into=st.integers(0, 9))
    def remap(self, drop: int, into: int) -> None:
        new_value = np.arange(10)
        new_value[drop] = into
        self.table.remap(new_value)
        self.model = {d: (into if v == drop else v) for d, v in self.model.items()}
        self.model = {d: v for d, v in self.model.items() if v}

    @invariant()
    def agrees(self) -> None:
        assert self.table.values(digest_keys(_POOL)).tolist() == [
            self.model.get(d, 0) for d in _POOL
        ]
        assert self.table.lookup_digests(_POOL[:10])[1] == [
            self.model.get(d, 0) for d in _POOL[:10]
        ]
        assert len(self.table) == len(self.model)
        keys, values = self.table.items_where(np.ones(10, dtype=bool))
        assert dict(zip(key_bytes(keys), values.tolist(), strict=True)) == self.model


TestTableAgainstDict = TableAgainstDict.TestCase
TestTableAgainstDict.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_batch_of_new_keys_aiming_at_one_bucket_spills_along_the_chain() -> None:
    table = DigestTable()
    same_home = [bytes(8) + k.to_bytes(8, "little") for k in range(1, 40)]
    keys = digest_keys(same_home)
    slots, values = table.lookup(keys)
    assert (slots == -1).all() and (values == 0).all()
    table.assign(keys, slots, np.arange(1, 40))
    assert table.values(keys).tolist() == list(range(1, 40))
    # deleting keys early in the chain leaves the later ones reachable
    table.assign(keys[:20], table.lookup(keys[:20])[0], np.zeros(20))
    assert table.values(keys).tolist() == [0] * 20 + list(range(21, 40))


def test_the_compact_index_costs_at_most_64_bytes_per_block_and_replica() -> None:
    """Digests included: the caller's digest objects are gone after each store (as the event
    intake drops them), so whatever the index keeps of them is counted."""
    n = 50_000
    index = CompactFleetIndex()
    tracemalloc.start()
    try:
        for _ in range(0, n, 64):
            index.store("pod-0", [os.urandom(16) for _ in range(64)])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    blocks = index.num_blocks("pod-0")
    assert blocks >= n
    assert used / blocks <= 64
