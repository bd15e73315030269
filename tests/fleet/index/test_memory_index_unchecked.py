"""The in-memory index's paths for callers with well-formed arguments (a fleet replay's feed):
the same index as the checked calls, and ``longest_elsewhere`` as ``match`` reads it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import InvalidArgumentError
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.medium import CPU, GPU

CHAIN = [bytes([k]) * 16 for k in range(12)]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 11),
        st.integers(1, 12),
        st.sampled_from([GPU, CPU, None]),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(0, 11), st.integers(1, 40))
def test_unchecked_writes_and_longest_elsewhere_agree_with_the_checked_calls(
    ops: list[tuple[str, str, int, int, str | None]], start: int, cap: int
) -> None:
    checked = MemoryFleetIndex(max_blocks_per_replica=cap)
    unchecked = MemoryFleetIndex(max_blocks_per_replica=cap)
    for kind, rep, lo, hi, medium in ops:
        digests = CHAIN[lo:hi]
        if kind == "store":
            checked.store(rep, digests, medium or GPU)
            unchecked.store_unchecked(rep, digests, medium or GPU)
        elif kind == "remove":
            checked.remove(rep, digests, medium)
            unchecked.remove_unchecked(rep, digests, medium)
        else:
            checked.clear(rep)
            unchecked.clear(rep)
    for digests in (CHAIN, CHAIN[start:], []):
        matches = checked.match(digests)
        assert unchecked.match(digests) == matches
        for rep in ("a", "b", "c", "z"):
            most = max((m.blocks for m in matches if m.replica != rep), default=0)
            assert checked.longest_elsewhere(digests, rep) == most
    for rep in checked.replicas():
        assert unchecked.holdings(rep) == checked.holdings(rep)
        assert unchecked.overflow(rep) == checked.overflow(rep)
        assert unchecked.num_blocks_many([rep], GPU) == checked.num_blocks_many([rep], GPU)
    assert unchecked.replicas() == checked.replicas()


def test_longest_elsewhere_checks_its_digests() -> None:
    index = MemoryFleetIndex()
    with pytest.raises(InvalidArgumentError):
        index.longest_elsewhere([b"short"], "a")
    with pytest.raises(InvalidArgumentError):
        index.longest_elsewhere(b"x" * 16, "a")  # type: ignore[arg-type]


def test_the_digest_check_names_the_bad_digest_in_a_list() -> None:
    index = MemoryFleetIndex()
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        index.store("a", [CHAIN[0], b"x" * 15])
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        index.store("a", [CHAIN[0], bytearray(16)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        index.match([CHAIN[0], 7])  # type: ignore[list-item]
    assert index.replicas() == []
