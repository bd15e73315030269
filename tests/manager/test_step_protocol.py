"""The step protocol and the defects it closes: each test failed on the manager before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixcache import (
    CacheManager,
    ConfigError,
    InvalidTokensError,
    Namespace,
    OutOfBlocksError,
    PrefixCacheError,
)
from prefixcache.errors import InvalidArgumentError
from tests.kv_fingerprint import FingerprintRuntime
from tests.snapshot import snapshot

NS = Namespace(model="m")


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- 1. a listener and the eviction of a whole first-level node -------------------------------
def test_listener_survives_evicting_a_first_level_node():
    m = CacheManager(num_blocks=3, block_size=2)
    events = []
    m.add_listener(events.append)
    m.admit("a", [1, 2])
    m.release("a")
    m.admit("c", [3, 4])
    m.release("c")
    m.admit("b", [1, 2, 9, 9, 9])  # evicts the whole node of [3, 4], a child of the root
    m.check_integrity()
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 1 and removed[0].namespace == Namespace()


# ---- 2. blocks whose K/V never came are not served --------------------------------------------
def test_abort_unindexes_blocks_nobody_computed():
    m = CacheManager(8, 4)
    m.admit("r", list(range(9)))
    assert m.abort("r") == ["r"]
    assert m.admit("r2", list(range(9))).cached_len == 0
    assert m.stats.unindexed_blocks == 2
    m.check_integrity()


def test_release_after_the_forward_pass_keeps_the_blocks():
    m = CacheManager(8, 4, stepped=True)
    m.admit("r", list(range(9)))
    m.end_step()
    m.release("r")
    assert m.admit("r2", list(range(9))).cached_len == 8


def test_abort_drops_requests_that_share_unwritten_blocks():
    m = CacheManager(16, 4, stepped=True)
    rt = FingerprintRuntime(m)
    rt.admit("a", toks(0, 9), NS)
    rt.admit("b", toks(0, 8) + [50, 51], NS)  # hits a's two pending blocks
    rt.fork("a", "a2")
    rt.admit("c", toks(100, 5), NS)  # unrelated
    assert sorted(rt.abort("a"), key=str) == ["a", "a2", "b"]
    assert m.requests == ["c"] and m.lookup(toks(0, 9), NS).cached_blocks == 0
    rt.step()
    m.check_integrity()


def test_abort_reaches_the_forks_of_a_released_fork():
    # a's prefill never runs; a2 (forked from a) was released, but a3, forked from a2, still
    # reads a's unwritten partial block: it goes with a
    m = CacheManager(24, 4, stepped=True)
    rt = FingerprintRuntime(m)
    rt.admit("a", [0], NS)
    rt.fork("a", "a2")
    rt.fork("a2", "a3")
    rt.release("a2")
    assert rt.abort("a") == ["a", "a3"]
    assert m.requests == []
    rt.step()  # no read of K/V that was never written
    m.check_integrity()


def test_abort_keeps_what_an_earlier_step_wrote():
    m = CacheManager(16, 4, stepped=True)
    m.admit("a", toks(0, 8))
    m.end_step()
    m.append("a", toks(8, 4))  # fills block 2 in this step: pending
    assert m.abort("a") == ["a"]
    assert m.lookup(toks(0, 13)).cached_blocks == 2
    m.check_integrity()


def test_pins_cover_only_written_blocks():
    m = CacheManager(16, 4, stepped=True)
    m.admit("a", toks(0, 9))
    assert m.pin(toks(0, 9)) == (0, 0)
    m.end_step()
    handle, pinned = m.pin(toks(0, 9))
    assert handle and pinned == 8


# ---- 3. a copy's source is never handed out again within its step -----------------------------
def test_fork_owner_released_in_the_step_of_the_others_copy_on_write():
    m = CacheManager(6, 4, stepped=True, partial_copy=False)
    rt = FingerprintRuntime(m)
    rt.admit("a", toks(0, 6), NS)
    rt.fork("a", "b")
    rt.step()
    rt.append("b", [7])  # copies the shared partial block
    rt.release("a")  # its last owner leaves in the same step
    rt.admit("c", toks(200, 9), NS)  # takes every free block
    rt.step()  # b reads its copy: the source must not have been overwritten
    m.check_integrity()


def test_append_in_the_step_of_a_partial_copy():
    m = CacheManager(6, 4, stepped=True)
    rt = FingerprintRuntime(m)
    rt.admit("a", toks(0, 8), NS)
    rt.step()
    rt.release("a")
    rt.admit("b", toks(0, 4) + [4, 5, 99], NS)  # copies 2 slots of a's second block
    rt.append("b", [1])  # the copy source is no longer b's to hold
    rt.admit("c", toks(300, 12), NS)  # needs every block the pool can give
    rt.step()
    m.check_integrity()


# ---- 4. priority and retention are checked before anything changes ----------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"priority": 1, "retention": "1h"},
        {"priority": "high"},
        {"priority": 1, "retention": -1.0},
        {"priority": 1, "retention": float("nan")},
        {"priority": 1, "retention": True},
    ],
)
def test_bad_priority_or_retention_changes_nothing(kw):
    m = CacheManager(8, 4)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.admit("a", [1, 2, 3, 4, 5], **kw)
    assert snapshot(m) == before and m.block_counts().active == 0


# ---- 5. trimming a long node costs what it removes ---------------------------------------------
def test_tail_eviction_trims_in_place():
    m = CacheManager(64, 2)
    m.admit("a", toks(0, 120))
    m.release("a")
    (node,) = m.index.roots[Namespace()].children.values()
    buffers = (id(node.tokens), id(node.digests))
    m.admit("b", toks(500, 20))  # evicts 6 blocks from the tail of the 60-block node
    assert (id(node.tokens), id(node.digests)) == buffers and len(node.blocks) == 54
    m.check_integrity()


# ---- 6. namespaces do not accumulate ----------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_namespaces_are_forgotten_once_empty(caching):
    m = CacheManager(16, 4, enable_caching=caching)
    for i in range(3000):
        ns = Namespace(model="m", extra=(f"image-{i}",))
        m.admit(i, toks(0, 9), ns)
        m.release(i)
    assert len(m.index.roots) <= 8  # those whose 2 full blocks still fit in 16
    m.evict(16)
    assert not m.index.roots
    assert len(m.hasher._seeds) <= 4096
    m.check_integrity()


# ---- 7. a fully cached prompt that fills the pool exactly -------------------------------------
@pytest.mark.parametrize("stepped", [True, False])
def test_fully_cached_prompt_that_fills_the_pool(stepped):
    m = CacheManager(4, 4, stepped=stepped)
    rt = FingerprintRuntime(m)
    rt.admit("a", toks(0, 16), NS)
    rt.step()
    rt.release("a")
    assert m.can_admit(toks(0, 16), NS)
    assert rt.admit("b", toks(0, 16), NS) == 12  # the last block is recomputed, not copied
    assert m.stats.cow_copies == 0
    rt.step()  # b reads back exactly its K/V
    m.check_integrity()


# ---- 8. one canonical, injective namespace encoding ------------------------------------------
def test_lone_surrogates_are_rejected():
    with pytest.raises(InvalidArgumentError):
        Namespace(model="\ud83d\ude00")
    assert Namespace(model="😀").canonical_bytes() != Namespace(model="?").canonical_bytes()


def test_labels_tell_namespaces_apart():
    pairs = [
        (Namespace(model="m", adapter=""), Namespace(model="m")),
        (Namespace(model="m", extra=("a,b",)), Namespace(model="m", extra=("a", "b"))),
        (Namespace(model="default"), Namespace()),
        (Namespace(model="m", adapter_version="3"), Namespace(model="m")),
        (
            Namespace(model="m", adapter="a@3"),
            Namespace(model="m", adapter="a", adapter_version="3"),
        ),
    ]
    for a, b in pairs:
        assert a.label() != b.label() and a.canonical_bytes() != b.canonical_bytes()


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
namespaces = st.builds(
    Namespace,
    model=text,
    adapter=st.none() | text,
    adapter_version=st.none() | text,
    salt=st.none() | text,
    extra=st.lists(text, max_size=3).map(tuple),
)


@given(namespaces, namespaces)
def test_encoding_and_label_are_injective(a, b):
    if a != b:
        assert a.canonical_bytes() != b.canonical_bytes()
        assert a.label() != b.label()


# ---- 9. validation gaps -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens",
    [
        np.ma.masked_array([1, -5], mask=[False, True]),
        [1, True],
        [1, 2.0],
        [1, -1],
        [1, 2**31],
        [1, 2**70],
    ],
)
def test_bad_tokens_are_rejected(tokens):
    m = CacheManager(8, 4)
    before = snapshot(m)
    with pytest.raises(InvalidTokensError):
        m.admit("a", tokens)
    assert snapshot(m) == before


@pytest.mark.parametrize("call", ["admit", "lookup", "can_admit", "pin"])
def test_wrong_namespace_type_is_a_typed_error(call):
    m = CacheManager(8, 4)
    args = ("a", [1, 2, 3]) if call == "admit" else ([1, 2, 3],)
    with pytest.raises(InvalidArgumentError):
        getattr(m, call)(*args, "model-name")


def test_sizes_accept_numpy_and_tensor_ints_but_not_bools():
    m = CacheManager(np.int64(8), torch.tensor(4))
    assert (m.num_blocks, m.block_size) == (8, 4)
    m.admit("a", [1, 2, 3])
    assert m.can_append("a", np.int32(2)) and not m.can_append("a", 40)
    for bad in (-5, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            m.can_append("a", bad)
    with pytest.raises(InvalidArgumentError):
        m.evict(True)
    with pytest.raises(InvalidArgumentError):
        CacheManager(True, 4)


@pytest.mark.parametrize("token", [np.int64(7), torch.tensor(7), np.array(7), torch.tensor(7)[()]])
def test_a_scalar_token_appends(token):
    m = CacheManager(8, 4)
    m.admit("a", [1, 2, 3])
    res = m.append("a", token)
    assert len(res.slots) == 1 and m.token_ids("a").tolist() == [1, 2, 3, 7]


@pytest.mark.parametrize("token", [True, 1.0, np.float32(2), torch.tensor(2.0), -1])
def test_a_bad_scalar_token_is_rejected(token):
    m = CacheManager(8, 4)
    m.admit("a", [1, 2, 3])
    with pytest.raises(InvalidTokensError):
        m.append("a", token)


def test_can_admit_is_a_predicate():
    m = CacheManager(2, 4)
    assert m.can_admit(toks(0, 8)) and not m.can_admit(toks(0, 9))


@pytest.mark.parametrize(
    "slots, error",
    [([-2, 0], "slot"), ([0.0, 1.0], "integer"), ([0, 99], "outside")],
)
def test_kv_cache_rejects_bad_slots(slots, error):
    from prefixcache import PagedKVCache

    kv = PagedKVCache(1, 4, 4, 1, 8, dtype=torch.float32)
    k = torch.ones(2, 1, 8)
    with pytest.raises(PrefixCacheError, match=error):
        kv.write(0, k, k, torch.tensor(slots))
    assert float(kv.k[0].abs().sum()) == 0.0


def test_kv_cache_refuses_a_short_gather():
    from prefixcache import PagedKVCache

    kv = PagedKVCache(1, 4, 4, 1, 8)
    with pytest.raises(PrefixCacheError):
        kv.gather(0, [0, 1], 12)  # 12 tokens need 3 blocks
    with pytest.raises(PrefixCacheError):
        kv.write(0, torch.ones(2, 1, 8), torch.ones(3, 1, 8), [0, 1])


# ---- 10. lookup and the partial copy agree, and take the longest match ------------------------
def test_lookup_counts_the_partial_copy():
    m = CacheManager(16, 4)
    m.admit("a", toks(0, 8))
    m.release("a")
    q = toks(0, 6) + [99, 98]
    assert m.lookup(q).cached_len == 6
    assert m.admit("b", q).cached_len == 6


def test_partial_copy_takes_the_longest_sibling():
    m = CacheManager(32, 4)
    m.admit("long", [1, 2, 3, 4, 5, 6, 7, 8])  # block 1 shares 3 tokens with the query
    m.admit("short", [1, 2, 3, 4, 5, 9, 9, 9])  # shares 1, and is the most recent
    m.release("long")
    m.release("short")
    adm = m.admit("q", [1, 2, 3, 4, 5, 6, 7, 0, 1])
    assert adm.cached_len == 7 and adm.partial_tokens == 3


# ---- 11. no empty copies ----------------------------------------------------------------------
def test_block_size_one_fully_cached_prompt_has_no_empty_copy():
    m = CacheManager(8, 1)
    m.admit("a", [1, 2, 3])
    m.release("a")
    adm = m.admit("b", [1, 2, 3])
    assert adm.cached_len == 2 and adm.copies == []


# ---- 12. the list path still validates --------------------------------------------------------
def test_list_input_equals_array_input():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**31 - 1, 2000, dtype=np.int64).astype(np.int32)
    arr[:3] = [0, 1, 2**31 - 1]
    a, b = CacheManager(256, 16), CacheManager(256, 16)
    assert a.admit("x", arr.tolist()) == b.admit("x", arr)
    assert a.lookup(arr.tolist()) == b.lookup(arr)


def test_errors_are_prefixcache_errors():
    assert issubclass(InvalidArgumentError, PrefixCacheError)
    assert issubclass(ConfigError, PrefixCacheError)
    with pytest.raises(OutOfBlocksError):
        m = CacheManager(2, 4)
        m.admit("a", toks(0, 8))
        m.admit("b", toks(100, 8))


def test_forks_of_a_long_lived_unconfirmed_request_are_not_kept_for_ever() -> None:
    """Without steps a request's writes are confirmed at its release only, so forks taken from
    a long-lived one depend on it; the released ones that neither indexed blocks nor have forks
    of their own are forgotten (memory stays bounded), the others still reach an abort."""
    m = CacheManager(64, 4)
    prompt = list(range(12))
    m.admit("sys", prompt)
    m.append("sys", 5)
    for i in range(1000):
        m.fork("sys", i)
        m.append(i, 7)
        m.release(i)
    assert len(m.internals.states["sys"].dependents) < 64
    m.fork("sys", "kept")  # live, and forked again after its own release
    m.fork("kept", "grandchild")
    m.release("kept")
    for i in range(1000, 1100):
        m.fork("sys", i)
        m.release(i)
    assert m.abort("sys") == ["sys", "grandchild"]
    m.check_integrity()


def test_abort_lets_go_of_a_released_readers_hold_on_the_aborted_blocks():
    # r copies from w's pending block, appends (its copy source becomes a step hold) and is
    # released in the same step; aborting w then removed a held node (an assertion)
    m = CacheManager(8, 4, stepped=True)
    m.admit("w", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.admit("r", [1, 2, 3, 4, 5, 6, 0, 0, 0]).partial_tokens == 2
    m.append("r", 1)
    m.release("r")
    assert m.abort("w") == ["w"]
    m.check_integrity()
    m.end_step()
    m.check_integrity()
    assert m.block_counts().active == 0
