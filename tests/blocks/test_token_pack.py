"""The C helpers (compiled build) that pack a list of plain ints and check an int32 array's
bytes, and the Python paths they fall back to, agree on every input: the same bytes, or the same
typed error."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import prefixcache
from prefixcache.blocks import tokens as token_module
from prefixcache.errors import InvalidTokensError

_ITEMS = st.one_of(
    st.integers(0, 2**31 - 1),
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, -1, 2**63, -(2**63) - 1, True, False]),
    st.builds(np.int64, st.integers(0, 100)),
    st.builds(np.int32, st.integers(0, 100)),
)


def _module():
    if not prefixcache.CORE_BUILD.compiled:
        pytest.skip(f"the C helper belongs to the compiled build ({prefixcache.CORE_BUILD.reason})")
    from prefixcache.blocks import _token_pack

    return _token_pack


def _helper():
    return _module().pack_token_list


def test_the_helper_packs_plain_ints_and_declines_everything_else() -> None:
    pack = _helper()
    ids = [0, 1, 7, 2**31 - 1, 65_535]
    assert pack(ids) == np.array(ids, dtype="<i4").tobytes()
    assert pack([]) == b""
    for bad in ([1, -1], [2**31], [2**64], [True, 2], [1, np.int64(2)], [1.0], ["1"], [None]):
        assert pack(bad) is None, bad
    with pytest.raises(TypeError, match="expects a list"):
        pack((1, 2))  # type: ignore[arg-type]


def test_the_range_check_reads_every_sign_bit() -> None:
    check = _module().int32_nonnegative
    assert check(b"")
    assert check(np.array([0, 1, 2**31 - 1, 255, 65_536], dtype="<i4").tobytes())
    for value in (-1, -(2**31), -256, -(2**24)):
        for where in range(5):
            ids = np.arange(5, dtype="<i4")
            ids[where] = value
            assert not check(ids.tobytes()), (value, where)
    with pytest.raises(ValueError, match="multiple of 4"):
        check(b"\x00\x00\x00")
    with pytest.raises(TypeError, match="expects bytes"):
        check(bytearray(4))  # type: ignore[arg-type]


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=0, max_size=40), st.booleans())
def test_the_array_path_agrees_with_the_general_one(ids: list[int], strided: bool) -> None:
    """An int32 array, contiguous or not, gives as_token_bytes what as_token_array gives."""
    arr = np.array(ids, dtype="<i4")
    if strided:
        arr = np.repeat(arr, 2)[::2]  # the same ids, not contiguous
    try:
        expected: bytes | str = token_module.as_token_array(arr).tobytes()
    except InvalidTokensError as exc:
        expected = str(exc)
    try:
        got: bytes | str = token_module.as_token_bytes(arr)
    except InvalidTokensError as exc:
        got = str(exc)
    assert got == expected


@given(st.lists(_ITEMS, min_size=1, max_size=40))
def test_the_list_paths_agree_with_the_general_one(items: list[object]) -> None:
    """Whatever the list holds, as_token_bytes answers as the array path does."""
    try:
        expected: bytes | str = np.asarray(token_module.as_token_array(list(items))).tobytes()
    except InvalidTokensError:
        expected = "error"
    try:
        got: bytes | str = token_module.as_token_bytes(list(items))
    except InvalidTokensError:
        got = "error"
    assert got == expected


def test_the_python_sources_do_without_the_helper() -> None:
    code = (
        "import prefixcache\n"
        "from prefixcache.blocks import tokens\n"
        "assert tokens._pack_plain_ints is None, tokens._pack_plain_ints\n"
        "assert tokens._nonnegative is None, tokens._nonnegative\n"
        "assert tokens.as_token_bytes([1, 2, 3]) == bytes([1,0,0,0,2,0,0,0,3,0,0,0])\n"
        "try:\n"
        "    import prefixcache.blocks._token_pack\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {**os.environ, "PREFIXCACHE_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "refused: prefixcache.blocks._token_pack belongs to the compiled build" in out
