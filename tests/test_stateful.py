"""Random admit / append / fork / release / evict / pin sequences against every DESIGN.md invariant.

Besides ``check_integrity`` after each step, a fake K/V store follows the manager's instructions
as a runtime's forward pass does (each token id stands in for its K/V): a step admits one to
three prompts, then writes every new token at its slot, then runs the step's copies. Reading any
live request through its block table must give back exactly its tokens: shared blocks are never
overwritten by a non-owner, no hit is served from a block holding other tokens, and copies may
read blocks indexed earlier in the same step.
"""

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from prefixcache import CacheManager, Namespace, OutOfBlocksError, RequestTooLargeError
from tests.snapshot import snapshot

P = 4
NUM_BLOCKS = 24
NAMESPACES = [
    Namespace(model="m"),
    Namespace(model="m", salt="t2"),
    Namespace(model="m", adapter="a"),
]
BASES = [list(range(0, 11)), list(range(0, 6)) + [50, 51, 52, 53, 54], [7] * 9]

prompts = (
    st.tuples(
        st.integers(0, len(BASES) - 1), st.integers(0, 11), st.lists(st.integers(0, 3), max_size=9)
    )
    .map(lambda t: BASES[t[0]][: t[1]] + t[2])
    .filter(bool)
)


STEPS = [0]  # invariant checks run, i.e. steps taken (reported by test_enough_steps)


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(NUM_BLOCKS, P, policy="lru")
        self.store = np.full((NUM_BLOCKS, P), -1, dtype=np.int64)  # token id per slot
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.pins: list[int] = []

    def _copy(self, copies):
        for src, dst, n in copies:
            self.store[dst, :n] = self.store[src, :n]

    def _write(self, slots, values):
        for s, v in zip(slots.tolist(), values, strict=False):
            self.store[s // P, s % P] = v

    @rule(
        target=requests,
        batch=st.lists(st.tuples(prompts, st.integers(0, 2)), min_size=1, max_size=3),
    )
    def admit(self, batch):
        writes, copies, ids = [], [], []
        for tokens, ns in batch:
            rid = self.next_id
            self.next_id += 1
            ids.append(rid)
            before = snapshot(self.mgr)
            try:
                adm = self.mgr.admit(rid, tokens, NAMESPACES[ns])
            except (OutOfBlocksError, RequestTooLargeError):
                assert snapshot(self.mgr) == before
                continue  # unknown to the manager: later rules on this id are no-ops
            assert 0 <= adm.cached_len < len(tokens)
            writes.append((adm.slot_mapping(), tokens[adm.cached_len :]))
            copies += adm.copies
            self.tokens[rid] = list(tokens)
        for slots, values in writes:  # the step's K/V stores, then its copies
            self._write(slots, values)
        self._copy(copies)
        return multiple(*ids)

    @rule(rid=requests, new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, rid, new):
        if rid not in self.tokens:
            return
        before = snapshot(self.mgr)
        try:
            res = self.mgr.append(rid, new)
        except OutOfBlocksError:
            assert snapshot(self.mgr) == before
            return
        self._write(res.slots, new)
        self._copy(res.copies)
        self.tokens[rid] += new

    @rule(target=requests, rid=requests)
    def fork(self, rid):
        if rid not in self.tokens:
            return rid
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])
        return child

    @rule(rid=consumes(requests))
    def release(self, rid):
        if rid in self.tokens:
            self.mgr.release(rid)
            del self.tokens[rid]

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        cached = self.mgr.block_counts().cached
        assert self.mgr.evict(n) == min(n, cached)

    @rule(tokens=prompts, ns=st.integers(0, 2))
    def pin(self, tokens, ns):
        handle, _ = self.mgr.pin(tokens, NAMESPACES[ns])
        if handle:
            self.pins.append(handle)

    @rule()
    def unpin(self):
        if self.pins:
            self.mgr.unpin(self.pins.pop(0))

    @invariant()
    def consistent(self):
        STEPS[0] += 1
        self.mgr.check_integrity()
        counts = self.mgr.block_counts()
        assert counts.total == NUM_BLOCKS
        for rid, tokens in self.tokens.items():
            table = self.mgr.block_table(rid)
            got = [int(self.store[table[i // P], i % P]) for i in range(len(tokens))]
            assert got == tokens, f"request {rid} reads wrong K/V through its table"
        for node in self.mgr.index.iter_nodes():  # cached content is what the index claims
            stored = self.store[list(node.blocks)].reshape(-1).tolist()
            assert stored == np.frombuffer(bytes(node.tokens), dtype="<i4").tolist()

    def teardown(self):
        for rid in list(self.tokens):
            self.mgr.release(rid)
        for h in self.pins:
            self.mgr.unpin(h)
        self.mgr.check_integrity()
        counts = self.mgr.block_counts()
        assert counts.active == 0 and counts.free + counts.cached == NUM_BLOCKS


# At least 2,000 steps in CI; PREFIXCACHE_STATEFUL_EXAMPLES=N runs more.
CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PREFIXCACHE_STATEFUL_EXAMPLES", "100")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheMachine = CacheMachine.TestCase


def test_enough_steps():
    """Runs after the machine (file order): the invariants were checked at least 2,000 times."""
    assert STEPS[0] >= 2000, f"only {STEPS[0]} stateful steps ran"
