"""Random steps of admit / append / fork / release / abort / pin / evict against every invariant.

Each step interleaves those calls in any order, then runs the forward pass through the K/V
fingerprint runtime (stores, copies, reads) and ends the step. After every call the manager's
integrity check runs; after every step every live request must read exactly its own K/V, every
cached block must hold the K/V of the prefix it claims, and the block events must describe the index
exactly. All three eviction policies, a listener attached, a small stepped pool; a pool of five
blocks (a fully cached prompt fills it); a manager without steps, where each call is its own step as
a simple user's would be (every call's K/V is written before the next); and a tiny GPU pool over a
host tier, where every step runs its offloads and loads first and every host slot must hold the K/V
of the prefix its entry claims; and a shared store (with and without a host tier), where computed
blocks are written through after their step, loaded back (after restarts with an empty cache too),
and lost between an admission's query and its load. With tenant shares (changed at run time too),
another tenant's admission never takes a tenant under its guarantee unless nothing else was
evictable, and the per-tenant counts are checked after every call.
"""

import os
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from prefixcache import CacheManager, Namespace, OutOfBlocksError, RequestTooLargeError
from prefixcache.manager.tenant_shares import TenantShare
from tests.kv_fingerprint import FingerprintRuntime, FingerprintStore
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
    host_blocks = 0
    shares: ClassVar[dict[str, TenantShare] | None] = None
    with_store = False
    steps: ClassVar[list[int]] = [0]
    tier: ClassVar[list[int]] = [0, 0, 0]  # offloaded, loaded, host-evicted blocks
    store_counts: ClassVar[list[int]] = [0, 0, 0]  # store loads, failed loads, written blocks

    def __init__(self):
        super().__init__()
        self.kv_store = FingerprintStore() if self.with_store else None
        self.mgr = CacheManager(
            self.num_blocks,
            P,
            policy=self.policy,
            stepped=self.stepped,
            host_blocks=self.host_blocks,
            shares=self.shares,
            store=self.kv_store,
        )
        self.rt = FingerprintRuntime(self.mgr, kv_store=self.kv_store)
        self.next_id = 0
        self.pins: list[int] = []
        self.seen: list[tuple[list[int], int]] = []  # prompts admitted so far

    def _pick(self, i):
        ids = sorted(self.rt.live)
        return ids[i % len(ids)] if ids else None

    @rule(tokens=prompts, ns=st.integers(0, 2), priority=st.integers(0, 2))
    def admit(self, tokens, ns, priority):
        self._admit(tokens, ns, priority)

    def _admit(self, tokens, ns, priority):
        rid = self.next_id
        self.next_id += 1
        before = snapshot(self.mgr)
        ahead = self.mgr.lookup(tokens, NAMESPACES[ns])
        can = self.mgr.can_admit(tokens, NAMESPACES[ns])
        loaded = self.mgr.stats.loaded_blocks
        kept = self._guaranteed()
        try:
            cached = self.rt.admit(rid, tokens, NAMESPACES[ns], priority=priority, retention=5.0)
        except (OutOfBlocksError, RequestTooLargeError):
            assert not can and snapshot(self.mgr) == before
            return
        assert can and 0 <= cached < len(tokens)
        if kept is not None and NAMESPACES[ns].salt != "t2":  # another tenant's admission
            held, breaks = kept
            now = self.mgr.tenant_stats().get("t2")
            assert now is not None and (now.cached_blocks >= held or now.guarantee_breaks > breaks)
        if self.kv_store is None:  # a store may lose a block between two queries
            assert cached == ahead.cached_len  # lookup promises exactly what admit gives
        assert self.mgr.stats.loaded_blocks - loaded == ahead.host_blocks
        self.seen.append((tokens, ns))

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

    def _guaranteed(self) -> tuple[int, int] | None:
        """With shares: what tenant t2 must keep through another tenant's admission (its
        cached blocks up to its guarantee) and its guarantee breaks so far."""
        shares = self.mgr.shares
        if shares is None or "t2" not in shares:
            return None
        row = self.mgr.tenant_stats().get("t2")
        cached = row.cached_blocks if row is not None else 0
        breaks = row.guarantee_breaks if row is not None else 0
        return min(cached, shares["t2"].guaranteed), breaks

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
        st = self.mgr.stats
        for i, n in enumerate((st.offloaded_blocks, st.loaded_blocks, st.host_evicted_blocks)):
            type(self).tier[i] += n
        if self.kv_store is not None:
            counts = (self.kv_store.loaded, self.kv_store.failed, len(self.kv_store.blocks))
            for i, n in enumerate(counts):
                type(self).store_counts[i] += n
        self.rt.step()
        for rid in list(self.rt.live):
            self.rt.release(rid)
        for h in self.pins:
            self.mgr.unpin(h)
        self.mgr.end_step()
        self.mgr.check_integrity()
        counts = self.mgr.block_counts()
        assert counts.active == 0 and counts.free + counts.cached == self.num_blocks


class HostTierMachine(CacheMachine):
    """With a host tier: prompts seen before come back, so evicted prefixes are loaded."""

    @rule(i=st.integers(0, 40))
    def admit_again(self, i):
        if self.seen:
            tokens, ns = self.seen[i % len(self.seen)]
            self._admit(tokens, ns, 0)

    @rule()
    def drain(self):
        """Finish every request: what they wrote becomes evictable (and so offloadable)."""
        self.rt.step()
        for rid in list(self.rt.live):
            self.rt.finish(rid)


class StoreMachine(HostTierMachine):
    """With a shared store (and maybe a host tier): what one step computed is written through,
    a fresh cache loads it back, and blocks vanish from the store between the admission's
    query and its load (the load fails and the request is aborted)."""

    @rule(i=st.integers(0, 40))
    def lose(self, i):
        assert self.kv_store is not None
        self.kv_store.drop(i)

    @rule()
    def restart(self):
        """The runtime restarts with an empty cache: only the store remembers."""
        self.rt.step()
        for rid in list(self.rt.live):
            self.rt.release(rid)
        for h in self.pins:
            self.mgr.unpin(h)
        self.pins = []
        self.mgr.end_step()
        self.mgr.reset()
        self.rt.check_cached()


class ShareMachine(CacheMachine):
    """With tenant shares that change at run time."""

    @rule(guaranteed=st.integers(0, 8), cap=st.one_of(st.none(), st.integers(8, 16)))
    def reshare(self, guaranteed, cap):
        guaranteed = min(guaranteed, self.num_blocks)
        self.mgr.set_shares({"t2": TenantShare(guaranteed, cap)})


class HostShareMachine(HostTierMachine):
    """A host tier and tenant shares that change at run time."""

    reshare = ShareMachine.reshare


# At least 3,000 steps per policy in CI; PREFIXCACHE_STATEFUL_EXAMPLES=N runs more.
EXAMPLES = int(os.environ.get("PREFIXCACHE_STATEFUL_EXAMPLES", "150"))
MIN_STEPS = 3000


SHARES = {"t2": TenantShare(6, 12)}


@pytest.mark.parametrize(
    "policy, num_blocks, stepped, host_blocks, shares",
    [
        ("lru", 12, True, 0, "store"),
        ("lru", 6, True, 8, "store"),
        ("lru", NUM_BLOCKS, True, 0, None),
        ("lfu", NUM_BLOCKS, True, 0, None),
        ("priority", NUM_BLOCKS, True, 0, None),
        ("lru", 5, True, 0, None),
        ("lru", NUM_BLOCKS, False, 0, None),
        ("lru", 6, True, 8, None),
        ("lru", 12, True, 0, SHARES),
        ("priority", 6, True, 8, {"t2": TenantShare(2, 4)}),
    ],
)
def test_cache_machine(policy, num_blocks, stepped, host_blocks, shares):
    attrs = {
        "policy": policy,
        "num_blocks": num_blocks,
        "stepped": stepped,
        "host_blocks": host_blocks,
        "shares": None if shares == "store" else shares,
        "with_store": shares == "store",
        "steps": [0],
        "tier": [0, 0, 0],
        "store_counts": [0, 0, 0],
    }
    name = f"CacheMachine_{policy}_{num_blocks}_{stepped}_{host_blocks}_{bool(shares)}"
    if shares == "store":
        base = StoreMachine
    elif shares is None:
        base = HostTierMachine if host_blocks else CacheMachine
    else:
        base = HostShareMachine if host_blocks else ShareMachine
    machine = type(name, (base,), attrs)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,  # the same examples on every run: a coverage check cannot flake
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    counts = f"host {machine.tier}, store {machine.store_counts}"
    print(f"{machine.__name__}: {machine.steps[0]} stateful steps, {counts}")
    assert machine.steps[0] >= MIN_STEPS, f"only {machine.steps[0]} stateful steps ran"
    if host_blocks:  # the tier offloaded, loaded and evicted blocks (with a store: offloaded)
        assert (machine.tier[0] if shares == "store" else min(machine.tier)) > 0, machine.tier
    if shares == "store":  # blocks were written and loaded back; without a host tier some
        loaded, failed, written = machine.store_counts  # loads found their block gone
        assert loaded > 0 and written > 0 and (failed > 0 or host_blocks), machine.store_counts
