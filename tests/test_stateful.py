"""Random steps of admit / append / fork / release / abort / pin / evict against every invariant.

Each step interleaves those calls in any order, then runs the forward pass through the K/V
fingerprint runtime (stores, copies, reads) and ends the step. After every call the manager's
integrity check runs; after every step every live request must read exactly its own K/V, every
cached block must hold the K/V of the prefix it claims, and the block events must describe the
index exactly. All three eviction policies, a listener attached, a small stepped pool; a pool
of five blocks (a fully cached prompt fills it); and a manager without steps, where each call is
its own step as a simple user's would be (every call's K/V is written before the next).
"""

import os
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from prefixcache import CacheManager, Namespace, OutOfBlocksError, RequestTooLargeError
from tests.kv_fingerprint import FingerprintRuntime
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
rids = st.integers(0, 40)


class CacheMachine(RuleBasedStateMachine):
    policy = "lru"
    num_blocks = NUM_BLOCKS
    stepped = True
    steps: ClassVar[list[int]] = [0]

    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(self.num_blocks, P, policy=self.policy, stepped=self.stepped)
        self.rt = FingerprintRuntime(self.mgr)
        self.next_id = 0
        self.pins: list[int] = []

    def _pick(self, i):
        ids = sorted(self.rt.live)
        return ids[i % len(ids)] if ids else None

    @rule(tokens=prompts, ns=st.integers(0, 2), priority=st.integers(0, 2))
    def admit(self, tokens, ns, priority):
        rid = self.next_id
        self.next_id += 1
        before = snapshot(self.mgr)
        try:
            cached = self.rt.admit(rid, tokens, NAMESPACES[ns], priority=priority, retention=5.0)
        except (OutOfBlocksError, RequestTooLargeError):
            assert snapshot(self.mgr) == before
            return
        assert 0 <= cached < len(tokens)

    @rule(i=rids, new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, i, new):
        rid = self._pick(i)
        if rid is None or rid in self.rt.finished:
            return
        before = snapshot(self.mgr)
        can = self.mgr.can_append(rid, len(new))
        try:
            self.rt.append(rid, new)
        except OutOfBlocksError:
            assert not can and snapshot(self.mgr) == before
            return
        assert can

    @rule(i=rids)
    def fork(self, i):
        rid = self._pick(i)
        if rid is None or rid in self.rt.finished:
            return
        self.rt.fork(rid, self.next_id)
        self.next_id += 1

    @rule(i=rids)
    def finish(self, i):
        rid = self._pick(i)
        if rid is not None and rid not in self.rt.finished:
            self.rt.finish(rid)

    @rule(i=rids)
    def abort(self, i):
        rid = self._pick(i)
        if rid is not None and rid not in self.rt.finished:
            dropped = self.rt.abort(rid)
            assert dropped[0] == rid and not set(dropped) & set(self.mgr.requests)

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

    @rule()
    def step(self):
        self.rt.step()

    @invariant()
    def consistent(self):
        type(self).steps[0] += 1
        if not self.stepped:  # without steps, K/V is written before the next call
            self.rt.step()
        self.mgr.check_integrity()
        counts = self.mgr.block_counts()
        assert counts.total == self.num_blocks

    def teardown(self):
        self.rt.step()
        for rid in list(self.rt.live):
            self.rt.release(rid)
        for h in self.pins:
            self.mgr.unpin(h)
        self.mgr.end_step()
        self.mgr.check_integrity()
        counts = self.mgr.block_counts()
        assert counts.active == 0 and counts.free + counts.cached == self.num_blocks


# At least 3,000 steps per policy in CI; PREFIXCACHE_STATEFUL_EXAMPLES=N runs more.
EXAMPLES = int(os.environ.get("PREFIXCACHE_STATEFUL_EXAMPLES", "150"))
MIN_STEPS = 3000


@pytest.mark.parametrize(
    "policy, num_blocks, stepped",
    [
        ("lru", NUM_BLOCKS, True),
        ("lfu", NUM_BLOCKS, True),
        ("priority", NUM_BLOCKS, True),
        ("lru", 5, True),
        ("lru", NUM_BLOCKS, False),
    ],
)
def test_cache_machine(policy, num_blocks, stepped):
    attrs = {"policy": policy, "num_blocks": num_blocks, "stepped": stepped, "steps": [0]}
    machine = type(f"CacheMachine_{policy}_{num_blocks}_{stepped}", (CacheMachine,), attrs)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"{machine.__name__}: {machine.steps[0]} stateful steps")
    assert machine.steps[0] >= MIN_STEPS, f"only {machine.steps[0]} stateful steps ran"
