"""A token group (siblings that start with the same token, in token order) kept in buckets
answers as one sorted list would, whatever the bucket size, through adds, removals and splits."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheManager
from prefixcache.blocks.radix import GROUP_BUCKET, Node, TokenGroup

_KEYS = st.binary(min_size=4, max_size=4)


def _expected_neighbours(keys: list[bytes], query: bytes) -> tuple[bytes, bytes | None]:
    """What one sorted list gives: the key before the query's place (the first key when none),
    and the one at that place (None past the end or when the first key was taken)."""
    i = bisect_left(keys, query)
    if i == 0:
        return keys[0], None
    return keys[i - 1], keys[i] if i < len(keys) else None


@settings(max_examples=300, deadline=None)
@given(
    bucket=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), _KEYS, _KEYS), min_size=1, max_size=80),
)
def test_buckets_answer_as_one_sorted_list(bucket: int, ops: list[tuple[bool, bytes, bytes]]):
    first, second = b"\x00\x00\x00\x01", b"\x00\x00\x00\x02"
    nodes = {first: Node(None, 0), second: Node(None, 0)}
    group = TokenGroup([first, second], [nodes[first], nodes[second]], bucket)
    for add, key, query in ops:
        if add and key not in nodes:
            nodes[key] = Node(None, 0)
            group.add(key, nodes[key])
        elif not add and key in nodes and len(nodes) > 1:
            group.remove(nodes.pop(key), key)
        keys = sorted(nodes)
        assert group.check() is None
        assert len(group) == len(keys) and group.keys() == keys
        assert group.nodes() == [nodes[k] for k in keys]
        before, after = _expected_neighbours(keys, query)
        got_before, got_after = group.neighbours(query)
        assert got_before[0] == before and got_before[1] is nodes[before]
        if after is None:
            assert got_after is None
        else:
            assert got_after is not None and got_after[0] == after and got_after[1] is nodes[after]
    if len(nodes) == 1:
        assert group.only() is next(iter(nodes.values()))


def test_a_crowded_divergence_point_stays_whole() -> None:
    # a system prompt that ends inside a block: every request's branch starts with its last
    # tokens, so all of them are siblings in one token group, many buckets long
    block, capacity = 4, 4 * GROUP_BUCKET * 3
    system = list(range(1, 7))  # a block and a half
    m = CacheManager(capacity, block)
    rng = np.random.default_rng(5)
    for i in range(5 * GROUP_BUCKET):  # more than the pool holds: branches get evicted too
        m.admit(i, system + rng.integers(100, 10_000, 6).tolist())
        m.release(i)
    m.check_integrity()
    (root,) = m.index.roots.values()
    (shared,) = root.children.values()
    (group,) = shared.by_token.values()
    assert isinstance(group, TokenGroup) and len(group.key_buckets) > 2
    # a question whose first token equals a cached one's: the partial match finds that sibling
    sibling = np.frombuffer(group.keys()[GROUP_BUCKET], dtype="<i4").tolist()
    got = m.lookup(system + [sibling[2], 99, 99, 99, 99, 99])
    assert got.cached_len == block + 3  # the shared block, then 3 tokens copied from the sibling
    # a prompt that needs the whole pool evicts every branch: the group empties cleanly
    m.admit("big", [10_001] * (block * (capacity - 1)))
    m.check_integrity()
    assert not shared.children and shared.by_token is None


def test_removals_do_not_leave_a_trail_of_small_buckets() -> None:
    keys = [i.to_bytes(4, "big") for i in range(1, 20_001)]
    nodes = {k: Node(None, 0) for k in keys}
    group = TokenGroup(keys[:2], [nodes[k] for k in keys[:2]])
    for k in keys[2:]:
        group.add(k, nodes[k])
    kept = keys[::128]
    for i, k in enumerate(keys):
        if i % 128:
            group.remove(nodes[k], k)
    assert group.check() is None and group.keys() == kept
    # 157 survivors: a few buckets, not one each as without merging
    assert len(group.key_buckets) <= 2 * len(kept) // GROUP_BUCKET + 1
