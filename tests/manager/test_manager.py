import numpy as np
import pytest
import torch

from prefixcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheInUseError,
    CacheManager,
    Copy,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidTokensError,
    Namespace,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownRequestError,
)
from prefixcache.manager.results import slots_of
from tests.snapshot import snapshot

NS = Namespace(model="m")


def toks(start, n):
    return list(range(start, start + n))


def mgr_(num_blocks=32, block_size=4, **kw):
    return CacheManager(num_blocks, block_size, **kw)


def test_cold_admit_allocates_and_indexes_full_blocks():
    m = mgr_()
    adm = m.admit("a", toks(0, 10), NS)
    assert adm.cached_len == 0 and len(adm.block_table) == 3 and adm.copies == []
    assert adm.slot_mapping().tolist() == [adm.block_table[i // 4] * 4 + i % 4 for i in range(10)]
    counts = m.block_counts()
    assert (counts.free, counts.active, counts.cached) == (29, 3, 0)
    assert m.index.num_blocks == 2  # two full blocks indexed, the partial one is private
    m.check_integrity()


def test_shared_prefix_hits_whole_blocks_only():
    m = mgr_()
    a = m.admit("a", toks(0, 10), NS)
    b = m.admit("b", toks(0, 9) + [99], NS)  # differs at token 9 (inside block 2)
    assert b.cached_len == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    m.check_integrity()
    assert m.stats.hit_tokens == 8 and m.stats.lookup_tokens == 20


def test_released_blocks_stay_cached_and_are_reused():
    m = mgr_()
    a = m.admit("a", toks(0, 13), NS)
    m.release("a")
    counts = m.block_counts()
    assert (counts.active, counts.cached) == (0, 3)
    b = m.admit("b", toks(0, 13), NS)
    assert b.cached_len == 12 and b.block_table[:3] == a.block_table[:3]
    m.check_integrity()


def test_fully_cached_prompt_recomputes_exactly_one_token():
    m = mgr_()
    a = m.admit("a", toks(0, 12), NS)
    m.release("a")
    b = m.admit("b", toks(0, 12), NS)
    assert b.cached_len == 11
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.copies == [Copy(a.block_table[2], b.block_table[2], 3)]
    assert b.slot_mapping().tolist() == [b.block_table[2] * 4 + 3]
    assert m.stats.cow_copies == 1
    m.check_integrity()
    m.release("b")
    m.check_integrity()
    assert m.block_counts().active == 0


def test_partial_block_copy_and_switch():
    base = toks(0, 8)
    for partial, expect in ((True, 6), (False, 4)):
        m = mgr_(partial_copy=partial)
        a = m.admit("a", base, NS)
        b = m.admit("b", base[:6] + [77, 78], NS)  # shares 2 tokens of block 1
        assert b.cached_len == expect
        if partial:
            assert b.copies == [Copy(a.block_table[1], b.block_table[1], 2)]
            assert m.stats.partial_copy_tokens == 2
        else:
            assert b.copies == []
        m.check_integrity()


def test_partial_copy_always_leaves_one_token_to_compute():
    m = mgr_()
    m.admit("a", toks(0, 8), NS)
    b = m.admit("b", toks(0, 7), NS)  # all 7 tokens are cached, the last must be computed
    assert b.cached_len == 6
    m.check_integrity()


def test_append_allocates_and_commits_filled_blocks():
    m = mgr_()
    m.admit("a", toks(0, 6), NS)
    r = m.append("a", [6, 7, 8])
    table = m.block_table("a")
    assert len(table) == 3 and r.copies == []
    assert r.slots.tolist() == [table[1] * 4 + 2, table[1] * 4 + 3, table[2] * 4]
    assert m.index.num_blocks == 2  # block 1 filled and entered the index
    m.check_integrity()
    m.release("a")
    assert m.admit("b", toks(0, 9), NS).cached_len == 8


def test_append_without_slot_mapping_changes_nothing_else():
    mapped, unmapped = mgr_(), mgr_()
    for m in (mapped, unmapped):
        m.admit("a", toks(0, 6), NS)
        m.fork("a", "b")  # b's first write copies the shared partial block
    for tokens in ([6, 7, 8], 9, np.arange(10, 40, dtype=np.int32)):
        for rid in ("a", "b"):
            full = mapped.append(rid, tokens)
            bare = unmapped.append(rid, tokens, map_slots=False)
            assert len(bare.slots) == 0 and bare.slots.dtype == np.int64
            assert bare.copies == full.copies and len(full.slots) == np.size(tokens)
            assert mapped.block_table(rid) == unmapped.block_table(rid)
    assert mapped.stats == unmapped.stats
    unmapped.check_integrity()


def test_the_appender_does_what_append_does():
    plain, fast = mgr_(num_blocks=24), mgr_(num_blocks=24)
    append = fast.appender()
    for m in (plain, fast):
        m.admit("a", toks(0, 6), NS)
        m.fork("a", "b")  # b's first write copies the shared partial block
    runs = ([6, 7, 8], [9], list(range(10, 30)), [30], [31, 32])
    for tokens in runs:
        for rid in ("a", "b"):
            want = plain.append(rid, tokens, map_slots=False)
            got = append(rid, np.array(tokens, dtype="<i4").tobytes())
            assert got.copies == want.copies and len(got.slots) == 0
            assert fast.block_table(rid) == plain.block_table(rid)
    assert fast.stats == plain.stats and snapshot(fast) == snapshot(plain)
    with pytest.raises(OutOfBlocksError):  # as append: nothing left to grow into
        append("a", bytes(4 * 64))
    fast.check_integrity()
    fast.reset(force=True)  # the appender serves the manager across a reset
    fast.admit("c", toks(0, 3), NS)
    append("c", (3).to_bytes(4, "little"))
    assert fast.block_table("c") and fast.index.num_blocks == 1


def test_admitting_with_the_prompts_digests_does_what_hashing_it_does():
    plain, given = mgr_(num_blocks=24), mgr_(num_blocks=24)
    prompts = [toks(0, 13), toks(0, 9) + [90, 91, 92], toks(0, 13) + [7, 8, 9], toks(50, 3)]
    for k, prompt in enumerate(prompts):
        want = plain.admit(k, prompt, NS)
        got = given.admit(k, prompt, NS, digests=given.hasher.hash_prompt(prompt, NS))
        assert got == want
        if k % 2:
            plain.release(k)
            given.release(k)
    assert given.stats == plain.stats and snapshot(given) == snapshot(plain)
    given.check_integrity()


@pytest.mark.parametrize(
    "digests",
    [b"x" * 48, "abc", 7, [bytes(16)] * 2, [bytes(16)] * 4, [bytes(16), bytes(16), b"short"]],
)
def test_admit_refuses_digests_that_do_not_fit_the_prompt(digests):
    m = mgr_()
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.admit("a", toks(0, 13), NS, digests=digests)  # 3 full blocks of 4
    assert snapshot(m) == before
    m.admit("a", toks(0, 13), NS)  # it was not admitted


@pytest.mark.parametrize(
    ("request_id", "data", "error"),
    [
        ("nobody", b"\x01\x00\x00\x00", UnknownRequestError),
        ("a", [1, 2], InvalidTokensError),
        ("a", bytearray(4), InvalidTokensError),
        ("a", b"\x01\x00\x00", InvalidTokensError),
        ("a", b"", InvalidTokensError),
        ("a", (-1).to_bytes(4, "little", signed=True), InvalidTokensError),
    ],
)
def test_the_appender_refuses_bad_input_and_changes_nothing(request_id, data, error):
    m = mgr_()
    m.admit("a", toks(0, 6), NS)
    before = snapshot(m)
    with pytest.raises(error):
        m.appender()(request_id, data)
    assert snapshot(m) == before


def test_slot_mapping_short_and_long_runs_agree():
    table = [(7 * b + 3) % 31 for b in range(30)]  # 120 slots of 4-token blocks
    for start, end in [(0, 0), (0, 1), (5, 6), (3, 17), (1, 65), (1, 66), (3, 110), (0, 120)]:
        want = [table[t // 4] * 4 + t % 4 for t in range(start, end)]
        got = slots_of(table, 4, start, end)
        assert got.dtype == np.int64 and got.tolist() == want


def test_fork_shares_everything_and_copies_on_write():
    m = mgr_()
    m.admit("a", toks(0, 6), NS)
    m.fork("a", "b")
    assert m.block_table("a") == m.block_table("b")
    last = m.block_table("a")[-1]
    assert m.pool.refcount[last] == 2
    r = m.append("b", [100])
    assert r.copies == [Copy(last, m.block_table("b")[-1], 2)]
    assert m.pool.refcount[last] == 1 and m.block_table("a")[-1] == last
    r2 = m.append("a", [200])
    assert r2.copies == []  # now exclusively owned: written in place
    m.check_integrity()
    m.release("a")
    m.release("b")
    m.check_integrity()
    assert m.block_counts().active == 0


def test_forks_that_fill_identical_blocks_share_one_cached_copy():
    m = mgr_()
    m.admit("a", toks(0, 6), NS)
    m.fork("a", "b")
    m.append("a", [6, 7])
    m.append("b", [6, 7])  # same tokens: b's block is a duplicate, not a second cached copy
    assert m.index.num_blocks == 2
    m.check_integrity()
    m.release("a")
    m.release("b")
    m.check_integrity()
    assert m.block_counts().cached == 2 and m.block_counts().free == 30


def test_eviction_takes_exactly_the_deficit_lru_order():
    m = mgr_(num_blocks=6)
    m.admit("a", toks(0, 8), NS)
    m.release("a")
    m.admit("b", toks(100, 8), NS)
    m.release("b")
    m.admit("c", toks(200, 4) + [1], NS)  # 2 blocks: 2 free exist, no eviction needed
    assert m.stats.evicted_blocks == 0
    m.admit("d", toks(300, 4), NS)  # 1 block: evicts exactly one, from a's (older) leaf tail
    assert m.stats.evicted_blocks == 1
    assert m.lookup(toks(0, 8), NS).cached_blocks == 1
    assert m.lookup(toks(100, 8), NS).cached_blocks == 2
    m.check_integrity()


def test_eviction_never_touches_referenced_blocks():
    m = mgr_(num_blocks=4)
    m.admit("a", toks(0, 8), NS)
    with pytest.raises(OutOfBlocksError, match="free or evictable"):
        m.admit("b", toks(100, 12), NS)
    assert m.can_admit(toks(100, 8), NS)
    assert not m.can_admit(toks(100, 12), NS)
    m.check_integrity()


def test_lfu_and_priority_policies():
    m = mgr_(num_blocks=4, policy="lfu")
    m.admit("hot", toks(0, 4) + [9], NS)
    m.release("hot")
    for i in range(3):
        m.admit(i, toks(0, 4) + [9], NS)
        m.release(i)
    m.admit("cold", toks(50, 4) + [9], NS)
    m.release("cold")
    m.admit("x", toks(90, 8) + [1], NS)  # needs 3 blocks, 2 free: evicts the least hit
    assert m.lookup(toks(0, 5), NS).cached_blocks == 1
    assert m.lookup(toks(50, 5), NS).cached_blocks == 0

    t = [0.0]
    m = mgr_(num_blocks=4, policy="priority", clock=lambda: t[0])
    m.admit("keep", toks(0, 4) + [9], NS, priority=10, retention=100)
    m.release("keep")
    t[0] = 1
    m.admit("other", toks(50, 4) + [9], NS)
    m.release("other")
    t[0] = 2
    m.admit("x", toks(90, 8) + [1], NS)
    assert m.lookup(toks(0, 5), NS).cached_blocks == 1  # high priority survives
    m.release("x")
    t[0] = 500  # retention over: priority falls back to 0, plain LRU applies
    m.admit("y", toks(200, 8) + [1], NS)
    assert m.lookup(toks(0, 5), NS).cached_blocks == 0
    m.check_integrity()


def test_lookup_promises_the_partial_copy_admit_makes():
    """The copy source is the least recently used leaf: the admission's own allocation evicted
    it, so lookup promised 6 cached tokens and admit gave 4 (another block was evictable)."""
    m = CacheManager(4, 4)
    m.admit("a", [1, 2, 3, 4, 5, 6, 7, 8])
    m.release("a")
    m.admit("x", [7, 7, 7, 7, 7])
    m.release("x")
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 9]
    promised = m.lookup(prompt)
    got = m.admit("b", prompt)
    assert promised.cached_len == got.cached_len == 6 and got.partial_tokens == 2
    assert got.copies == [Copy(1, got.block_table[1], 2)]
    m.check_integrity()
    # no room to keep the source held: both recompute the partial block's tokens
    tight = CacheManager(3, 4)
    tight.admit("a", [1, 2, 3, 4, 5, 6, 7, 8])
    tight.release("a")
    promised = tight.lookup([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9])
    got = tight.admit("b", [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9])
    assert promised.cached_len == got.cached_len
    tight.check_integrity()


def test_decoded_blocks_carry_the_requests_priority():
    """Blocks a priority request fills by decoding are kept like its prompt's, also when they
    land in a node of their own (a fork holds the prompt's node, so it is not extended)."""
    for forked in (False, True):
        m = CacheManager(16, 2, policy="priority")
        m.admit("hi", [1, 2, 3, 4], priority=5)
        if forked:
            m.fork("hi", "sibling")
        m.append("hi", [5, 6])
        if forked:
            m.release("sibling")
        m.release("hi")
        m.admit("lo", [9, 9, 9, 9])  # cached later, priority 0: it goes first
        m.release("lo")
        m.evict(1)
        assert m.lookup([1, 2, 3, 4, 5, 6, 7]).cached_blocks == 3, forked
        m.check_integrity()


def test_the_higher_live_priority_wins_on_shared_blocks():
    """Claims of several requests on one prefix: a default request lifts a lower priority left
    by another, and a lower claim that outlives a higher one takes over when that one ends."""
    t = [0.0]
    m = mgr_(num_blocks=4, policy="priority", clock=lambda: t[0])
    m.admit("old", toks(50, 4) + [9], NS)
    m.release("old")
    t[0] = 1
    m.admit("low", toks(0, 4) + [9], NS, priority=-1)  # forever, unless someone asks more
    m.release("low")
    for i in range(3):
        t[0] = 2 + i
        m.admit(i, toks(0, 4) + [9], NS)  # default requests share it: it counts as priority 0
        m.release(i)
    t[0] = 10
    m.admit("x", toks(90, 8) + [1], NS)  # 3 blocks, 2 free: one cached block goes
    assert m.lookup(toks(0, 5), NS).cached_blocks == 1  # the shared prefix stays (more recent)
    assert m.lookup(toks(50, 5), NS).cached_blocks == 0
    m.release("x")

    t[0] = 0.0
    m = mgr_(num_blocks=4, policy="priority", clock=lambda: t[0])
    m.admit("burst", toks(0, 4) + [9], NS, priority=3, retention=10)
    m.release("burst")
    t[0] = 1
    m.admit("steady", toks(0, 4) + [9], NS, priority=1)  # lower, but forever
    m.release("steady")
    t[0] = 2
    m.admit("other", toks(50, 4) + [9], NS)  # priority 0, used later than the prefix
    m.release("other")
    t[0] = 50  # the priority-3 retention is over; the priority-1 claim still holds
    m.admit("x", toks(90, 8) + [1], NS)
    assert m.lookup(toks(0, 5), NS).cached_blocks == 1
    assert m.lookup(toks(50, 5), NS).cached_blocks == 0
    m.check_integrity()


@pytest.mark.parametrize("handle", [True, 1.0, [1], "1"])
def test_unpin_takes_only_an_int_handle(handle) -> None:
    m = mgr_(num_blocks=4)
    m.admit("sys", toks(0, 8), NS)
    m.release("sys")
    real, _ = m.pin(toks(0, 8), NS)
    assert real == 1
    with pytest.raises(InvalidArgumentError, match="a pin handle is an int"):
        m.unpin(handle)
    assert list(m.internals.pins) == [1]  # still pinned
    m.unpin(real)


def test_pin_protects_a_prefix():
    m = mgr_(num_blocks=4)
    m.admit("sys", toks(0, 8), NS)
    m.release("sys")
    handle, pinned = m.pin(toks(0, 8), NS)
    assert pinned == 8
    with pytest.raises(OutOfBlocksError):
        m.admit("big", toks(100, 16), NS)
    m.check_integrity()
    m.unpin(handle)
    m.admit("big", toks(100, 16), NS)
    assert m.lookup(toks(0, 8), NS).cached_blocks == 0
    with pytest.raises(UnknownRequestError):
        m.unpin(handle)


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model="m2"),
        Namespace(model="m", adapter="lora-a"),
        Namespace(model="m", adapter="lora-a", adapter_version="2"),
        Namespace(model="m", salt="tenant-b"),
        Namespace(model="m", extra=("img:abc",)),
    ],
)
def test_namespace_isolation(other):
    m = mgr_()
    m.admit("a", toks(0, 12), NS)
    m.release("a")
    assert m.admit("b", toks(0, 12), other).cached_len == 0
    m.release("b")
    assert m.admit("c", toks(0, 12), NS).cached_len == 11
    m.check_integrity()


def test_forced_collisions_never_serve_wrong_blocks():
    m = mgr_(num_blocks=64)
    m.hasher.digest = lambda data: b"\x00" * 16  # every digest collides
    rng = np.random.default_rng(0)
    prompts = [toks(0, 8) + rng.integers(0, 3, 6).tolist() for _ in range(12)]
    prompts += [rng.integers(0, 3, 10).tolist() for _ in range(8)]
    for i, p in enumerate(prompts):
        adm = m.admit(i, p, NS)
        # a hit is only ever a prefix equal to an earlier prompt's tokens
        best = max((_common(p, q) for q in prompts[:i]), default=0)
        assert adm.cached_len <= best
        m.check_integrity()
        if i % 3 == 0:
            m.release(i)
    m.check_integrity()


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_events_carry_digests_tokens_and_namespace():
    m = mgr_(num_blocks=3)
    events = []
    m.add_listener(events.append)
    m.admit("a", toks(0, 9), NS)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].token_ids == toks(0, 8)
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    assert stored[0].block_hashes == m.hasher.hash_prompt(np.array(toks(0, 9)), NS)
    assert stored[0].namespace == NS and stored[0].block_size == 4
    m.release("a")
    m.admit("b", toks(50, 8), NS)  # needs 2 blocks: 1 free, evicts 1
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed[0].block_hashes == stored[0].block_hashes[1:]
    m.release("b")
    m.reset()
    assert isinstance(events[-1], AllBlocksCleared)


def test_events_carry_token_ids_while_a_listener_reads_them():
    m = mgr_(num_blocks=16, host_blocks=8)
    digests_only, everything = [], []
    m.add_listener(digests_only.append, token_ids=False)
    m.admit("a", toks(0, 9), NS)
    assert [e.token_ids for e in digests_only if isinstance(e, BlockStored)] == [[]]
    m.add_listener(everything.append)  # one listener reads them: every listener gets them
    m.append("a", [9, 10, 11])
    assert [e.token_ids for e in everything if isinstance(e, BlockStored)] == [toks(8, 4)]
    m.remove_listener(everything.append)
    m.release("a")
    m.admit("b", toks(50, 60), NS)  # offloads a's blocks to host: a CPU BlockStored
    offloaded = [e for e in digests_only if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert offloaded and all(e.token_ids == [] for e in offloaded)
    assert all(len(e.block_hashes) for e in digests_only if isinstance(e, BlockStored))
    m.add_listener(digests_only.append)  # added again: its last say counts
    m.release("b")
    m.admit("c", toks(200, 8), NS)
    assert [e for e in digests_only if isinstance(e, BlockStored)][-1].token_ids == toks(200, 8)
    with pytest.raises(InvalidArgumentError):
        m.add_listener(print, token_ids=1)
    m.check_integrity()


def test_a_listener_removing_itself_does_not_hide_the_event_from_the_next():
    m = mgr_(num_blocks=8)
    seen: dict[str, int] = {"a": 0, "b": 0}

    def once(event):
        seen["a"] += 1
        m.remove_listener(once)

    m.add_listener(once)
    m.add_listener(lambda event: seen.__setitem__("b", seen["b"] + 1))
    m.admit("a", toks(0, 4), NS)  # one BlockStored
    assert seen == {"a": 1, "b": 1}
    m.admit("b", toks(10, 4), NS)
    assert seen == {"a": 1, "b": 2}


def test_a_listener_that_raises_leaves_the_cache_consistent(caplog):
    """Events are emitted mid-operation: a failing listener (a closed event publisher) must not
    stop an admission half way (blocks leaked, refcounts without holders)."""
    m = mgr_(num_blocks=8)
    seen = []

    def broken(event):
        seen.append(event)
        raise RuntimeError("event plane down")

    m.add_listener(broken)
    a = m.admit("a", toks(0, 9), NS)  # stores two blocks: the listener raises
    m.check_integrity()
    assert m.requests == ["a"] and a.cached_len == 0
    assert m.internals.listener_errors == 1 and seen and "event plane down" in caplog.text
    m.release("a")
    m.admit("b", toks(100, 30), NS)  # evicts: BlockRemoved raises too
    m.check_integrity()
    counts = m.block_counts()
    assert counts.free + counts.active + counts.cached == 8
    m.release("b")
    m.reset()  # nothing leaked: no block is in use
    m.remove_listener(broken)
    with pytest.raises(InvalidArgumentError, match="not a listener"):
        m.remove_listener(broken)


def test_a_closed_publisher_stops_listening():
    from prefixcache.fleet.events.publisher import KVEventPublisher

    m = mgr_(num_blocks=8)
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    pub.attach(m)
    m.admit("a", toks(0, 9), NS)
    pub.close()
    m.admit("b", toks(50, 9), NS)  # no PublisherClosedError, no half-done admission
    m.check_integrity()
    assert m.internals.listener_errors == 0 and m.requests == ["a", "b"]


def test_reset_names_the_steps_holds_when_they_keep_blocks_in_use():
    m = CacheManager(8, 2, stepped=True)
    m.admit("a", [1, 2, 3])
    m.end_step()
    m.fork("a", "b")
    m.append("b", 4)  # the shared partial block is copied; its source is held until end_step
    m.release("a")
    m.release("b")
    with pytest.raises(CacheInUseError, match=r"0 requests and 0 pins and 1 holds of this step"):
        m.reset()
    m.end_step()
    m.reset()


def test_reset_refuses_while_in_use_unless_forced():
    m = mgr_()
    m.admit("a", toks(0, 9), NS)
    before = snapshot(m)
    with pytest.raises(CacheInUseError, match="force=True"):
        m.reset()
    assert snapshot(m) == before
    m.reset(force=True)
    assert m.block_counts().free == 32 and m.requests == []
    m.check_integrity()


def test_block_tables_tensor():
    m = mgr_()
    m.admit("a", toks(0, 10), NS)
    m.admit("b", toks(0, 4) + [5], NS)
    t = m.block_tables(["a", "b"])
    assert t.dtype == torch.int32 and t.shape == (2, 3)
    assert t[0].tolist() == m.block_table("a") and t[1].tolist() == m.block_table("b") + [-1]


def test_subtree_sizes():
    m = mgr_()
    m.admit("a", toks(0, 12), NS)
    m.admit("b", toks(0, 4) + toks(50, 8), NS)
    root = m.index.roots[NS]
    assert m.index.subtree_blocks(root) == 5  # one shared block + 2 + 2
    (shared,) = root.children.values()
    assert len(shared.blocks) == 1 and m.index.subtree_blocks(shared) == 5


def test_evict_api():
    m = mgr_()
    m.admit("a", toks(0, 12), NS)
    m.release("a")
    assert m.evict(2) == 2 and m.block_counts().cached == 1
    assert m.evict(10) == 1
    m.check_integrity()


# ---- rejected calls: typed error, state unchanged -------------------------------------------
def _loaded():
    m = mgr_(num_blocks=8)
    m.admit("a", toks(0, 10), NS)
    m.admit("b", toks(0, 4) + [7, 7], NS)
    m.release("b")
    return m


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda m: m.admit("a", toks(0, 4), NS), DuplicateRequestError),
        (lambda m: m.admit("x", [1, -2], NS), InvalidTokensError),
        (lambda m: m.admit("x", np.array([1.0, 2.0]), NS), InvalidTokensError),
        (lambda m: m.admit("x", [], NS), InvalidTokensError),
        # lists of 0-d arrays and tensors (what list(tensor) gives): floats and bools refused
        (lambda m: m.admit("x", [np.array(1.5)], NS), InvalidTokensError),
        (lambda m: m.admit("x", list(torch.tensor([1.5, 2.0])), NS), InvalidTokensError),
        (lambda m: m.admit("x", [torch.tensor(True), 2], NS), InvalidTokensError),
        (lambda m: m.admit("x", [np.array(True), 3], NS), InvalidTokensError),
        (lambda m: m.admit("x", [torch.tensor(1.0, requires_grad=True)], NS), InvalidTokensError),
        (lambda m: m.admit("x", toks(0, 33), NS), RequestTooLargeError),
        (lambda m: m.admit("x", toks(500, 28), NS), OutOfBlocksError),
        (lambda m: m.append("nope", [1]), UnknownRequestError),
        (lambda m: m.append("a", [2**31]), InvalidTokensError),
        (lambda m: m.append("a", 2**31), InvalidTokensError),
        (lambda m: m.append("a", -1), InvalidTokensError),
        (lambda m: m.append("a", True), InvalidTokensError),
        (lambda m: m.append("a", toks(0, 40)), OutOfBlocksError),
        (lambda m: m.release("b"), UnknownRequestError),
        (lambda m: m.block_tables(["a"], pad="x"), InvalidArgumentError),
        (lambda m: m.block_tables(5), InvalidArgumentError),
        (lambda m: m.block_tables("a"), InvalidArgumentError),
        (lambda m: m.block_tables(["a"], device="nope"), InvalidArgumentError),
        (lambda m: m.block_tables(["a"], device="cuda:7"), InvalidArgumentError),
        (lambda m: m.block_tables(["a"], device=1.5), InvalidArgumentError),
        (lambda m: m.reset(force="no"), InvalidArgumentError),
        (lambda m: m.reset(force=1), InvalidArgumentError),
        (lambda m: m.add_listener(5), InvalidArgumentError),
        (lambda m: m.fork("a", "a"), DuplicateRequestError),
        (lambda m: m.fork("nope", "z"), UnknownRequestError),
        (lambda m: m.block_table("nope"), UnknownRequestError),
    ],
)
def test_rejected_calls_leave_state_unchanged(call, error):
    m = _loaded()
    before = snapshot(m)
    with pytest.raises(error) as info:
        call(m)
    assert str(info.value)  # every error explains itself
    assert snapshot(m) == before
    m.check_integrity()


def test_double_release_is_an_error():
    m = mgr_()
    m.admit("a", toks(0, 5), NS)
    m.release("a")
    with pytest.raises(UnknownRequestError, match="not admitted"):
        m.release("a")


def test_caching_off_computes_everything():
    m = mgr_(enable_caching=False)
    m.admit("a", toks(0, 12), NS)
    m.release("a")
    assert m.admit("b", toks(0, 12), NS).cached_len == 0
    assert m.block_counts().cached == 0
    m.check_integrity()


def test_evictor_heap_stays_bounded_and_keeps_its_order():
    # the same cached leaves are re-pushed on every release: stale entries must be dropped
    m = mgr_(num_blocks=64, policy="lru")
    for i in range(8):
        m.admit(("warm", i), toks(100 * i, 8), NS)
        m.release(("warm", i))
    for round_ in range(3000):  # past the heap's slack of 1,024 stale entries
        i = round_ % 8
        m.admit(("hit", round_), toks(100 * i, 8), NS)
        m.release(("hit", round_))
    assert len(m.evictor._heap) <= 2 * m.index.num_nodes + 1024
    assert m.evict(2) == 2  # least recently used first: prompt (3000 - 8) % 8 = 0, both blocks
    assert m.lookup(toks(0, 8), NS).cached_blocks == 0
    assert all(m.lookup(toks(100 * i, 8), NS).cached_blocks == 2 for i in range(1, 8))
    m.check_integrity()


def test_copy_count_matches_the_copies_handed_out():
    for p in (1, 4):
        m = CacheManager(16, p)
        prompt = list(range(8))
        m.admit("a", prompt)
        m.release("a")
        adm = m.admit("b", prompt)  # every token cached: the last one is recomputed
        assert m.stats.cow_copies == len(adm.copies) == (0 if p == 1 else 1)
