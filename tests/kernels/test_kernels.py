"""Paged attention kernel vs attention over contiguous K/V.

On CPU the Triton kernel runs through the interpreter (TRITON_INTERPRET=1, set in conftest); on a
CUDA machine with the variable unset it runs compiled. Caches are NaN wherever no sequence owns a
slot and block tables are padded with the all-NaN block 0, so an unmasked load shows up as NaN.

The factor grid is a covering design, not the full product: every pair of (head_dim, block_size,
heads, dtype) values appears in some case; lengths and prefix shapes are covered within each case.
Tolerances: fp32 1e-5 (both sides accumulate in fp32), fp16 3e-3 and bf16 2e-2 (output rounding
plus P rounded to the input dtype before P @ V).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prefixcache.kernels import (
    AttentionConfig,
    PagedBatch,
    interpreter_enabled,
    paged_attention,
    reference_paged_attention,
    store_kv,
)
from prefixcache.kernels.testing import RandomBatch, contiguous_attention, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot needs a GPU")

# (head_dim, block_size, (Hq, Hkv), dtype): pairwise covering of 2 x 2 x 3 x 2 values.
GRID = [
    (64, 16, (4, 4), torch.float32),
    (128, 32, (4, 4), torch.float16),
    (64, 32, (8, 2), torch.float16),
    (128, 16, (8, 2), torch.float32),
    (128, 16, (4, 1), torch.float16),
    (64, 32, (4, 1), torch.float32),
]
BF16_GRID = [(128, 16, (8, 2), torch.bfloat16), (64, 32, (4, 1), torch.bfloat16)]
BF16_CASES = [pytest.param(c, marks=needs_cuda) for c in BF16_GRID]


def _ids(case: tuple) -> str:
    d, p, (hq, hkv), dtype = case
    return f"d{d}-p{p}-h{hq}x{hkv}-{str(dtype).removeprefix('torch.')}"


def _build(case: tuple, seq_lens: list[int], q_lens: list[int], **kw: Any) -> RandomBatch:
    d, p, (hq, hkv), dtype = case
    return make_paged_batch(
        seq_lens,
        q_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=p,
        dtype=dtype,
        device=DEVICE,
        **kw,
    )


def _run(batch: RandomBatch, **kw: Any) -> torch.Tensor:
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        **kw,
    )


def _check(batch: RandomBatch, out: torch.Tensor, scale: float | None = None) -> None:
    tol = TOL[batch.q.dtype]
    expected = contiguous_attention(batch, scale=scale)
    assert not out.isnan().any(), "NaN in output: the kernel read an unowned slot"
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def _decode_lens(p: int) -> list[int]:
    return [1, p - 1, p, p + 1, 3 * p + 5]


@pytest.mark.parametrize(
    "case", GRID + [pytest.param(c, marks=needs_cuda) for c in BF16_GRID], ids=_ids
)
def test_decode_lengths(case: tuple) -> None:
    """One query per sequence at lengths around block boundaries; sequences end mid-block."""
    lens = _decode_lens(case[1])
    batch = _build(case, lens, [1] * len(lens), seed=len(lens))
    _check(batch, _run(batch))


@pytest.mark.parametrize(
    "case", GRID + [pytest.param(c, marks=needs_cuda) for c in BF16_GRID], ids=_ids
)
def test_extend_over_cached_prefix(case: tuple) -> None:
    """Prefill (no prefix) and extend over cached prefixes of 0/16/19/40 tokens, 1-17 new tokens,
    mixed with a decode in the same batch."""
    gen = torch.Generator().manual_seed(case[0] + case[1])
    prefixes = [0, 16, 19, 40]
    new = [int(x) for x in torch.randint(1, 18, (len(prefixes),), generator=gen)]
    new[0] = 17  # a long prefill without prefix; multiple query blocks with small block_q
    seq_lens = [c + n for c, n in zip(prefixes, new, strict=True)] + [case[1] + 3]
    batch = _build(case, seq_lens, [*new, 1], seed=7)
    _check(batch, _run(batch))


@pytest.mark.parametrize(
    ("case", "shared", "pad_id"),
    [(GRID[0], 2, 0), (GRID[2], 1, -1), (GRID[4], 1, 0)],
    ids=["shared2-nanpad", "shared1-neg1pad", "mqa-shared1"],
)
def test_shared_prefix_blocks(case: tuple, shared: int, pad_id: int) -> None:
    """Sequences whose first blocks are the same physical blocks; padding -1 is never read."""
    p = case[1]
    seq_lens = [shared * p, shared * p + 1, shared * p + 9, (shared + 1) * p + 3]
    q_lens = [1, 1, 9, 4]
    batch = _build(case, seq_lens, q_lens, shared_prefix_blocks=shared, pad_id=pad_id, seed=3)
    assert (batch.block_tables[:, :shared] == batch.block_tables[0, :shared]).all()
    _check(batch, _run(batch))


CONFIGS = [
    # tile smaller than a block, several query blocks per sequence
    (GRID[1], AttentionConfig(block_q=4, block_m=16, tile_n=16)),
    # tile spanning two blocks, odd rows left over (block_q * group < block_m)
    (GRID[3], AttentionConfig(block_q=3, block_m=16, tile_n=32)),
    # MQA with a wide query block
    (GRID[5], AttentionConfig(block_q=8, block_m=32, tile_n=64)),
]


@pytest.mark.parametrize(("case", "config"), CONFIGS, ids=["tile<block", "rows-left", "mqa-wide"])
def test_explicit_configs(case: tuple, config: AttentionConfig) -> None:
    p = case[1]
    batch = _build(case, [p + 5, 2 * p + 1, 9], [p + 5, 6, 1], seed=11)
    _check(batch, _run(batch, config=config))


def test_non_power_of_two_group_and_block_size_8() -> None:
    """Hq/Hkv = 3 leaves padded rows; block size 8 makes every tile span several blocks."""
    batch = make_paged_batch(
        [5, 8, 9, 30],
        [5, 1, 2, 7],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        seed=5,
    )
    _check(batch, _run(batch, scale=0.3), scale=0.3)
    _check(
        batch,
        _run(batch, config=AttentionConfig(block_q=5, block_m=16, tile_n=16), scale=0.3),
        scale=0.3,
    )


@pytest.mark.parametrize(
    ("case", "q_lens", "num_splits"),
    [(GRID[0], [1] * 4, 4), (GRID[3], [1] * 4, 2), (GRID[4], [1, 3, 1, 9], 8)],
    ids=["decode-s4", "decode-s2-gqa", "extend-s8-mqa"],
)
def test_split_kv_matches_unsplit(case: tuple, q_lens: list[int], num_splits: int) -> None:
    """Flash-decoding path: splits (some empty for short sequences) merged by log-sum-exp."""
    p = case[1]
    batch = _build(case, [1, p + 1, 2 * p, 4 * p + 3], q_lens, seed=13)
    split = _run(batch, num_splits=num_splits)
    _check(batch, split)
    unsplit = _run(batch, num_splits=1)
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(split.float(), unsplit.float(), atol=tol, rtol=tol)


def test_out_argument_is_filled_in_place() -> None:
    batch = _build(GRID[0], [20, 3], [2, 3], seed=17)
    out = torch.empty_like(batch.q)
    assert _run(batch, out=out) is out
    _check(batch, out)


def test_empty_query_batch() -> None:
    batch = _build(GRID[0], [4], [1], seed=19)
    q = batch.q[:0]
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables[:0], empty, qsl)
    assert out.shape == q.shape


FULL_GRID = [
    (d, p, heads, dtype)
    for d in (64, 128)
    for p in (8, 16, 32)
    for heads in ((4, 4), (8, 2), (4, 1), (6, 2))
    for dtype in (torch.float32, torch.float16)
]


@pytest.mark.parametrize("seed", range(40))
def test_random_mixed_batches(seed: int) -> None:
    """Seeded fuzzing over the full factor grid: random lengths, prefix sharing and configs."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    case = FULL_GRID[pick(len(FULL_GRID))]
    p, group = case[1], case[2][0] // case[2][1]
    num_seqs = 1 + pick(4)
    shared = pick(3)
    q_lens = [1 if pick(2) else 1 + pick(20) for _ in range(num_seqs)]
    seq_lens = [max(shared * p, 1) + q + pick(3 * p) for q in q_lens]
    batch = _build(
        case, seq_lens, q_lens, shared_prefix_blocks=shared, pad_id=pick(2) - 1, seed=seed
    )
    choice = pick(3)
    if choice == 0:
        kw: dict[str, Any] = {}
    elif choice == 1:
        kw = {"num_splits": 1 << pick(4)}
    else:
        block_m = 16 << pick(3)
        kw = {
            "config": AttentionConfig(
                block_q=max(1, block_m // group - pick(2)),
                block_m=block_m,
                tile_n=16 << pick(3),
                num_splits=1 << pick(3),
            )
        }
    _check(batch, _run(batch, **kw))


@pytest.mark.parametrize(
    ("q_lens", "num_splits"),
    [([1, 1], 1), ([1, 1], 8), ([40, 1], 4)],
    ids=["decode", "decode-s8", "extend-s4"],
)
def test_long_context(q_lens: list[int], num_splits: int) -> None:
    """Hundreds of tokens: many loop iterations, and splits that each span several tiles."""
    batch = _build(GRID[3], [700, 1029], q_lens, shared_prefix_blocks=20, seed=23)
    _check(batch, _run(batch, num_splits=num_splits))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs ~9 GB of GPU memory")
def test_offsets_beyond_int32() -> None:
    """Cache elements past 2**31: block and slot offsets must be computed in int64."""
    hkv, d, p = 8, 128, 16
    per_block = p * hkv * d
    num_blocks = (1 << 31) // per_block + 64
    k_cache = torch.full((num_blocks, p, hkv, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    small = make_paged_batch(
        [40, 3],
        [5, 1],
        num_q_heads=32,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=p,
        dtype=torch.bfloat16,
        device="cuda",
        seed=29,
    )
    high = num_blocks - 40  # every used block lies past the int32 element range
    table = torch.where(small.block_tables > 0, small.block_tables + high, small.block_tables)
    for b in range(2):
        slots = small.slot_mapping(b) + high * p
        store_kv(small.keys[b], small.values[b], k_cache, v_cache, slots)
    args = (table, small.seq_lens, small.query_start_loc)
    out = paged_attention(small.q, k_cache, v_cache, *args)
    torch.testing.assert_close(
        out.float(), contiguous_attention(small).float(), atol=2e-2, rtol=2e-2
    )


def test_a_paged_batch_is_taken_whole() -> None:
    """``PagedBatch`` holds ``paged_attention``'s six tensors in its order: unpacked into it, or
    whole into the reference, it gives what the six tensors give."""
    batch = _build(GRID[0], [20, 5], [3, 1], seed=3)
    paged = PagedBatch(*batch)
    expected = reference_paged_attention(*batch)  # the six tensors, as before
    torch.testing.assert_close(reference_paged_attention(paged), expected)
    torch.testing.assert_close(paged_attention(*paged, backend="torch"), expected)
    _check(batch, expected)
