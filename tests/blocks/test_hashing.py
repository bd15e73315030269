import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from prefixcache import BlockHasher, ConfigError, InvalidTokensError, Namespace
from prefixcache.blocks.tokens import as_token_array, as_token_bytes

TOKENS = np.arange(1000, 1000 + 70, dtype="<i4")


def test_chain_matches_single_block_hashing():
    h = BlockHasher(16)
    ns = Namespace(model="m")
    digests = h.hash_prompt(TOKENS, ns)
    assert len(digests) == 4 and all(len(d) == 16 for d in digests)
    prev = h.seed(ns)
    for i, d in enumerate(digests):
        assert h.hash_block(prev, i, TOKENS[i * 16 : (i + 1) * 16].tobytes()) == d
        prev = d


def test_extending_hashes_only_new_blocks_and_agrees():
    h = BlockHasher(16)
    ns = Namespace()
    full = h.hash_prompt(TOKENS, ns)
    head = h.hash_blocks(TOKENS, h.seed(ns), 0, 2)
    tail = h.hash_blocks(TOKENS, head[-1], 2, 4)
    assert head + tail == full


def test_digest_depends_on_parent_position_and_tokens():
    h = BlockHasher(4)
    block = np.arange(4, dtype="<i4").tobytes()
    base = h.hash_block(b"\0" * 16, 0, block)
    assert h.hash_block(b"\1" * 16, 0, block) != base
    assert h.hash_block(b"\0" * 16, 1, block) != base
    assert h.hash_block(b"\0" * 16, 0, np.arange(1, 5, dtype="<i4").tobytes()) != base


@pytest.mark.parametrize("field", ["model", "adapter", "adapter_version", "salt", "extra"])
def test_every_namespace_field_changes_the_seed(field):
    h = BlockHasher(16)
    base = Namespace(model="m", adapter="a", adapter_version="1", salt="s", extra=("x",))
    changed = {"extra": ("y",)}.get(field, "other")
    other = Namespace(
        **{
            **{
                f: getattr(base, f)
                for f in ("model", "adapter", "adapter_version", "salt", "extra")
            },
            field: changed,
        }
    )
    assert h.hash_prompt(TOKENS, base)[0] != h.hash_prompt(TOKENS, other)[0]


def test_sha256_selectable_and_differs():
    a = BlockHasher(16, "sha256").hash_prompt(TOKENS, Namespace())
    b = BlockHasher(16, "xxh3_128").hash_prompt(TOKENS, Namespace())
    assert len(a) == len(b) == 4 and a != b
    with pytest.raises(ConfigError, match="unknown hash algorithm"):
        BlockHasher(16, "md5")


def test_deterministic_across_processes():
    code = (
        "import numpy as np\n"
        "from prefixcache import BlockHasher, Namespace\n"
        "t = np.arange(1000, 1070, dtype='<i4')\n"
        "for algo in ('xxh3_128', 'sha256'):\n"
        "    print(','.join(d.hex() for d in BlockHasher(16, algo)"
        ".hash_prompt(t, Namespace(model='m', salt='s'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.split()
    for algo, line in zip(("xxh3_128", "sha256"), out, strict=False):
        mine = BlockHasher(16, algo).hash_prompt(TOKENS, Namespace(model="m", salt="s"))
        assert line == ",".join(d.hex() for d in mine)


def test_wire_format_is_documented_layout():
    # h_0 = H(seed || int64 LE start position || int32 LE token ids);
    # seed = H(prefix || canonical namespace): per field a presence byte, a u32 LE length and
    # UTF-8 bytes (absent: one 0 byte); ``extra`` prefixed by its u32 LE count
    import xxhash

    ns = Namespace(model="m")
    canonical = b"\x01\x01\x00\x00\x00m" + b"\x00" * 3 + b"\x00\x00\x00\x00"
    assert ns.canonical_bytes() == canonical
    seed = xxhash.xxh3_128_digest(b"prefixcache/ns/v2\x00" + canonical)
    assert BlockHasher(4).seed(ns) == seed
    body = (0).to_bytes(8, "little") + np.arange(4, dtype="<i4").tobytes()
    digest = BlockHasher(4).hash_prompt(np.arange(4, dtype="<i4"), ns)[0]
    assert digest == xxhash.xxh3_128_digest(seed + body)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.uint16),
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2, 3], dtype=torch.int32),
    ],
)
def test_token_containers_accepted(tokens):
    arr = as_token_array(tokens)
    assert arr.dtype == np.dtype("<i4") and arr.tolist() == [1, 2, 3]
    assert as_token_bytes(tokens) == np.array([1, 2, 3], dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([], "empty"),
        ([1, -1], r"\[0, 2\*\*31\)"),
        ([2**31], r"\[0, 2\*\*31\)"),
        ([1.5, 2.0], "integers"),
        ([[1, 2]], "1-D"),
        ("abc", "string"),
        (np.array([True]), "integers"),
        (torch.tensor([1.0]), "integers"),
        (torch.tensor([True]), "integers"),
        ([1, "a"], "integers"),
        (np.array([-3], dtype=np.int32), ">= 0"),
        ([2**70], "integers|2\\*\\*31"),
        ([5, True, 7], "integers"),
        ([0, 9, False], "integers"),
        ([np.bool_(True), 4], "integers"),
        ([3, torch.tensor(True)], "integers"),
    ],
)
def test_bad_tokens_rejected(tokens, match):
    with pytest.raises(InvalidTokensError, match=match):
        as_token_array(tokens)
    with pytest.raises(InvalidTokensError, match=match):
        as_token_bytes(tokens)


def test_list_tokens_with_ids_zero_and_one_are_plain_ints():
    # 0 and 1 are where a bool would pack too: plain ints there pass
    tokens = [0, 1, 2**31 - 1, 1, 0]
    assert as_token_bytes(tokens) == np.array(tokens, dtype="<i4").tobytes()
    assert as_token_array(tokens).tolist() == tokens


def test_long_and_short_runs_hash_alike():
    # runs of >= 32 blocks take the buffered path, shorter ones the direct one: same digests
    h = BlockHasher(16)
    tokens = np.arange(16 * 40, dtype="<i4")
    long_run = h.hash_blocks(tokens, b"\x07" * 16, 3, 40)
    prev, one_by_one = b"\x07" * 16, []
    for i in range(3, 40):
        prev = h.hash_block(prev, i, tokens[i * 16 : (i + 1) * 16].tobytes())
        one_by_one.append(prev)
    assert long_run == one_by_one


@pytest.mark.parametrize(
    ("first", "end"),
    [(0, 5), (3, 20), (0, 40), (7, 90), (2, 2), (65_530, 65_545), (65_540, 65_600)],
)
def test_buffer_and_array_hash_alike(first, end):
    # token bytes (what the manager holds) and arrays, on both sides of the kept positions
    h = BlockHasher(1)
    tokens = np.arange(70_000, dtype="<i4") % 977
    want = [h.hash_block(b"\x05" * 16, first, tokens[first : first + 1].tobytes())]
    for i in range(first + 1, end):
        want.append(h.hash_block(want[-1], i, tokens[i : i + 1].tobytes()))
    want = want[: end - first]
    got = h.hash_blocks(tokens, b"\x05" * 16, first, end)
    assert got == want
    assert h.hash_buffer(tokens.tobytes(), b"\x05" * 16, first, end) == want
    assert h.hash_buffer(bytearray(tokens.tobytes()), b"\x05" * 16, first, end) == want


def test_matches_beyond_the_kept_positions():
    # a prompt of more blocks than the hasher keeps positions for is matched in full
    from prefixcache import CacheManager

    m = CacheManager(140_000, 1, partial_copy=False)
    prompt = np.arange(70_000, dtype="<i4") % 977
    m.admit("a", prompt[:66_000])
    m.release("a")
    assert m.admit("b", prompt).cached_len == 66_000
    m.check_integrity()


def test_namespace_keys_survive_pickling_across_processes():
    # a namespace keeps its hash; another process (another str hash seed) must rehash it
    ns = Namespace("m", adapter="a", salt="tenant", extra=("img",))
    script = (
        "import pickle, sys\n"
        "from prefixcache import Namespace\n"
        "sys.stdout.buffer.write(pickle.dumps({Namespace('m', adapter='a', salt='tenant',"
        " extra=('img',)): 7}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
    assert pickle.loads(out.stdout)[ns] == 7
    assert hash(pickle.loads(pickle.dumps(ns))) == hash(ns)


def test_shared_hasher_under_threads():
    # a router hashes outside its lock: concurrent growth of the kept positions stays correct
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            h = BlockHasher(3)
            barrier = threading.Barrier(6)

            def grow(h: BlockHasher = h, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                for end in range(1, 400, 7):
                    h.block_starts(end)

            threads = [threading.Thread(target=grow) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            starts = h.block_starts(400)
            assert list(starts[:400]) == [(i * 3).to_bytes(8, "little") for i in range(400)]
    finally:
        sys.setswitchinterval(old)
