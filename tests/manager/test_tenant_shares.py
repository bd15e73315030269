"""Tenant shares in the manager: a guarantee keeps a steady tenant's prefixes through another
tenant's burst, a cap makes a tenant evict its own blocks first, and the accounting is exact."""

import pytest

from prefixcache import CacheManager, ConfigError, Namespace
from prefixcache.manager.tenant_shares import TenantShare
from tests.kv_fingerprint import FingerprintRuntime
from tests.snapshot import snapshot

P = 16
STEADY = Namespace("m", salt="steady")
BURSTY = Namespace("m", salt="bursty")


def _steady_prompt(i: int) -> list[int]:
    """One of four 8-block system prompts, then 20 tokens of the request's own."""
    system = [1000 * (i % 4) + t for t in range(8 * P)]
    return system + [500_000 + 100 * i + t for t in range(20)]


def _burst_prompt(i: int) -> list[int]:
    return [1_000_000 + 10_000 * i + t for t in range(12 * P)]


def _steady_hit_rate(mgr: CacheManager, with_burst: bool) -> float:
    """Requests of the steady tenant interleaved with bursts of the other's unique prompts;
    the steady tenant's token hit rate after a warm-up round."""
    hit = total = 0
    burst = 0
    for i in range(200):
        rid = f"s{i}"
        tokens = _steady_prompt(i)
        adm = mgr.admit(rid, tokens, STEADY)
        mgr.release(rid)
        if i >= 4:
            hit += adm.cached_len
            total += len(tokens)
        if with_burst and i % 4 == 3:  # a burst: 12 unique prompts, more than the cache holds
            for _ in range(12):
                b = f"b{burst}"
                mgr.admit(b, _burst_prompt(burst), BURSTY)
                mgr.release(b)
                burst += 1
        mgr.check_integrity()
    return hit / total


def test_a_guarantee_keeps_the_steady_tenants_hit_rate_through_bursts():
    alone = _steady_hit_rate(CacheManager(96, P), with_burst=False)
    shared = _steady_hit_rate(CacheManager(96, P), with_burst=True)
    guarded_mgr = CacheManager(96, P, shares={"steady": TenantShare(40)})
    guarded = _steady_hit_rate(guarded_mgr, with_burst=True)
    assert alone > 0.8
    assert shared < alone / 2  # without a share the bursts flush the system prompts
    assert guarded == alone  # with one, the bursty tenant never touches them
    rows = guarded_mgr.tenant_stats()
    # its one-off blocks over the guarantee went; nothing it needed again, nothing under it
    assert rows["steady"].recomputed_after_others == 0 and rows["steady"].guarantee_breaks == 0
    assert rows["steady"].cached_blocks >= 40
    assert rows["bursty"].evicted_blocks > 0


def test_without_shares_the_neighbour_is_named():
    mgr = CacheManager(96, P, shares={})  # accounting only: the plain LRU order
    plain = CacheManager(96, P)
    assert _steady_hit_rate(mgr, True) == _steady_hit_rate(plain, True)
    rows = mgr.tenant_stats()
    assert rows["steady"].evicted_by_others > 0
    assert 0 < rows["steady"].recomputed_after_others <= rows["steady"].evicted_by_others
    assert rows["steady"].guaranteed == 0 and rows["steady"].cap is None


def test_recomputed_after_others_counts_exactly_the_blocks_a_neighbour_took():
    """A neighbour evicts the steady tenant's 8-block prompt; coming back with the first 3
    blocks, then the whole prompt, then a prompt that leaves it after block 5, the steady
    tenant recomputes 3, then 5, then nothing more of what the neighbour took."""
    mgr = CacheManager(8, P, shares={})
    system = list(range(8 * P))
    mgr.admit("a", system, STEADY)
    mgr.release("a")
    mgr.admit("b", _burst_prompt(0)[: 8 * P], BURSTY)  # takes all 8
    mgr.release("b")
    assert mgr.tenant_stats()["steady"].evicted_by_others == 8
    mgr.admit("c", system[: 3 * P], STEADY)
    mgr.release("c")
    assert mgr.tenant_stats()["steady"].recomputed_after_others == 3
    mgr.admit("d", system, STEADY)
    mgr.release("d")
    assert mgr.tenant_stats()["steady"].recomputed_after_others == 8
    other = CacheManager(8, P, shares={})
    other.admit("a", system, STEADY)
    other.release("a")
    other.admit("b", _burst_prompt(0)[: 8 * P], BURSTY)
    other.release("b")
    other.admit("c", system[: 5 * P] + [9] * (3 * P), STEADY)  # the same five, then others
    other.release("c")
    assert other.tenant_stats()["steady"].recomputed_after_others == 5
    other.check_integrity()


def test_a_cap_evicts_the_tenants_own_blocks_first_even_with_free_blocks():
    mgr = CacheManager(100, P, shares={"bursty": TenantShare(0, 24)})
    mgr.admit("s", _steady_prompt(0), STEADY)
    mgr.release("s")
    for i in range(5):
        mgr.admit(i, _burst_prompt(i), BURSTY)
        mgr.release(i)
        mgr.check_integrity()
        assert mgr.tenant_stats()["bursty"].cached_blocks <= 24
    rows = mgr.tenant_stats()
    assert rows["bursty"].cap_evictions == 5 * 12 - 24
    assert rows["steady"].evicted_blocks == 0
    assert mgr.block_counts().free > 0  # it evicted its own although blocks were free
    assert mgr.lookup(_burst_prompt(4), BURSTY).cached_blocks == 12  # the newest stayed


def test_running_requests_count_toward_a_cap_and_are_never_evicted():
    mgr = CacheManager(100, P, shares={"bursty": TenantShare(0, 8)})
    for i in range(3):  # all running: 36 blocks held, over the cap, none evictable
        mgr.admit(i, _burst_prompt(i), BURSTY)
    assert mgr.tenant_stats()["bursty"].cached_blocks == 36
    assert mgr.tenant_stats()["bursty"].cap_evictions == 0
    for i in range(3):
        mgr.release(i)
    mgr.admit(9, _burst_prompt(9), BURSTY)  # now it makes room from its own oldest
    assert mgr.tenant_stats()["bursty"].cached_blocks == 12
    mgr.check_integrity()


def test_a_guarantee_gives_way_only_when_nothing_else_is_evictable():
    mgr = CacheManager(20, P, shares={"steady": TenantShare(16)})
    mgr.admit("s", list(range(16 * P)), STEADY)  # 16 blocks: exactly its guarantee
    mgr.release("s")
    mgr.admit("b", _burst_prompt(0)[: 8 * P], BURSTY)  # needs 4 of them: admitted all the same
    rows = mgr.tenant_stats()
    assert rows["steady"].guarantee_breaks == 4 and rows["steady"].cached_blocks == 12
    mgr.check_integrity()


def test_shares_change_at_run_time_and_bad_shares_change_nothing():
    mgr = CacheManager(96, P)
    assert mgr.shares is None and mgr.tenant_stats() == {}
    _steady_hit_rate(mgr, with_burst=True)
    before = snapshot(mgr)
    for bad in (
        {"steady": TenantShare(97)},
        {"steady": TenantShare(-1)},
        {"steady": TenantShare(10, 5)},
        {"": TenantShare(1)},
        {None: TenantShare(1)},
        {"a": TenantShare(50), "b": TenantShare(50)},
        [("steady", 1)],
        {"steady": "lots"},
    ):
        with pytest.raises(ConfigError):
            mgr.set_shares(bad)  # type: ignore[arg-type]
        assert snapshot(mgr) == before
    mgr.set_shares({"steady": TenantShare(40)})
    mgr.check_integrity()
    assert dict(mgr.shares or {}) == {"steady": TenantShare(40)}
    assert set(mgr.tenant_stats()) == {"steady", "bursty"}
    guarded = _steady_hit_rate(mgr, with_burst=True)
    assert guarded == _steady_hit_rate(CacheManager(96, P), with_burst=False)
    mgr.reset()
    assert dict(mgr.shares or {}) == {"steady": TenantShare(40)}  # a reset keeps the shares
    mgr.set_shares(None)
    mgr.check_integrity()
    assert mgr.shares is None and mgr.tenant_stats() == {}


def test_shares_with_a_host_tier_and_the_fingerprint_runtime():
    """Every block read holds its prefix's K/V while shares steer eviction and offload."""
    mgr = CacheManager(24, 4, stepped=True, host_blocks=16, shares={"steady": TenantShare(8, 12)})
    rt = FingerprintRuntime(mgr)
    spaces = [STEADY, BURSTY, Namespace("m")]
    rid = 0
    for round_ in range(30):
        for k, ns in enumerate(spaces):
            base = [1000 * k + 50 * (round_ % 5) + j for j in range(12)]
            tokens = base + [round_, k]
            rt.admit(rid, tokens, ns)
            rid += 1
        rt.step()
        for r in list(rt.live):
            rt.finish(r)
        rt.step()
        mgr.check_integrity()
    assert mgr.stats.offloaded_blocks > 0 and mgr.stats.loaded_blocks > 0
