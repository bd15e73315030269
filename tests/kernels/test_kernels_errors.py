"""The wrappers reject bad inputs with typed errors whose messages say what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from prefixcache.kernels import (
    AttentionConfig,
    KernelDTypeError,
    KernelInputError,
    TritonUnavailableError,
    UnsupportedConfigError,
    interpreter_enabled,
    paged_attention,
    store_kv,
)
from prefixcache.kernels.testing import RandomBatch, make_paged_batch


@pytest.fixture
def batch() -> RandomBatch:
    return make_paged_batch(
        [20, 5], [3, 1], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=1
    )


def _attend(b: RandomBatch, **override: Any) -> torch.Tensor:
    args: dict[str, Any] = {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_tables": b.block_tables,
        "seq_lens": b.seq_lens,
        "query_start_loc": b.query_start_loc,
    }
    kwargs = {k: override.pop(k) for k in list(override) if k not in args}
    args |= override
    return paged_attention(*args.values(), **kwargs)


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _table(b: RandomBatch, row: int, col: int, value: int) -> torch.Tensor:
    table = b.block_tables.clone()
    table[row, col] = value
    return table


ATTENTION_ERRORS: list[tuple[str, Callable[[RandomBatch], dict], type[Exception], str]] = [
    ("q-not-tensor", lambda b: {"q": b.q.tolist()}, KernelDTypeError, "q must be a torch.Tensor"),
    ("q-int", lambda b: {"q": b.q.long()}, KernelDTypeError, "q has dtype torch.int64"),
    ("q-vs-cache", lambda b: {"q": b.q.half()}, KernelDTypeError, "cast one"),
    ("table-i64", lambda b: {"block_tables": b.block_tables.long()}, KernelDTypeError, "int32"),
    ("q-rank", lambda b: {"q": b.q[0]}, KernelInputError, r"\[total_q, num_q_heads"),
    ("v-shape", lambda b: {"v_cache": b.v_cache[:-1]}, KernelInputError, "differs from k_cache"),
    ("head-dim", lambda b: {"q": b.q[..., :32]}, KernelInputError, "q head_dim 32"),
    ("heads", lambda b: {"q": b.q[:, :3]}, KernelInputError, "multiple of num_kv_heads"),
    ("batch", lambda b: {"seq_lens": b.seq_lens[:1]}, KernelInputError, "batch sizes disagree"),
    ("qsl-start", lambda b: {"query_start_loc": _i32(1, 3, 4)}, KernelInputError, "start at 0"),
    ("qsl-end", lambda b: {"query_start_loc": _i32(0, 3, 5)}, KernelInputError, "total_q=4"),
    ("q-len-0", lambda b: {"query_start_loc": _i32(0, 4, 4)}, KernelInputError, "q_len=0"),
    ("seq<q", lambda b: {"seq_lens": _i32(2, 5)}, KernelInputError, "q_len <= seq_len"),
    (
        "narrow-table",
        lambda b: {"block_tables": b.block_tables[:, :1]},
        KernelInputError,
        "only 1 columns",
    ),
    (
        "id-too-big",
        lambda b: {"block_tables": _table(b, 0, 1, b.k_cache.shape[0])},
        KernelInputError,
        r"block_tables\[0, 1\]",
    ),
    ("id-negative", lambda b: {"block_tables": _table(b, 1, 0, -1)}, KernelInputError, "outside"),
    ("on-meta", lambda b: {"seq_lens": b.seq_lens.to("meta")}, KernelInputError, "seq_lens on"),
    (
        "strided-q",
        lambda b: {"q": b.q.transpose(1, 2).contiguous().transpose(1, 2)},
        UnsupportedConfigError,
        r"q\.contiguous\(\)",
    ),
    ("out-dtype", lambda b: {"out": b.q.half()}, KernelInputError, "out must match q"),
    (
        "both",
        lambda b: {"num_splits": 2, "config": AttentionConfig(1, 16, 16)},
        ValueError,
        "not both",
    ),
    (
        "bad-config",
        lambda b: {"config": AttentionConfig(block_q=4, block_m=16, tile_n=24)},
        UnsupportedConfigError,
        "power of two",
    ),
    (
        "config-rows",
        lambda b: {"config": AttentionConfig(block_q=9, block_m=16, tile_n=16)},
        UnsupportedConfigError,
        "block_q",
    ),
    ("backend", lambda b: {"backend": "cuda"}, ValueError, "backend must be"),
    # index tensors the kernel would step through as if contiguous: refused, not misread
    (
        "strided-table",
        lambda b: {"block_tables": b.block_tables.t().contiguous().t()},
        UnsupportedConfigError,
        r"block_tables\.contiguous\(\)",
    ),
    (
        "strided-seq-lens",
        lambda b: {"seq_lens": torch.stack([b.seq_lens, b.seq_lens], 1)[:, 0]},
        UnsupportedConfigError,
        r"seq_lens\.contiguous\(\)",
    ),
    (
        "strided-qsl",
        lambda b: {"query_start_loc": torch.stack([b.query_start_loc] * 2, 1)[:, 0]},
        UnsupportedConfigError,
        r"query_start_loc\.contiguous\(\)",
    ),
    *(
        (f"splits-{n}", lambda b, n=n: {"num_splits": n}, UnsupportedConfigError, "num_splits")
        for n in (0, -1, 3, 64, 2.5)
    ),
    (
        "workspace-dtype",
        lambda b: {"workspace": torch.zeros(10_000, dtype=torch.float16), "num_splits": 1},
        KernelInputError,
        "workspace must be",
    ),
    ("prefix-groups", lambda b: {"shared_prefix": [(0, 1)]}, KernelInputError, "PrefixGroup"),
    ("prefix-int", lambda b: {"shared_prefix": 3}, KernelInputError, "PrefixGroup"),
]


@pytest.mark.parametrize(
    ("override", "error", "match"),
    [case[1:] for case in ATTENTION_ERRORS],
    ids=[case[0] for case in ATTENTION_ERRORS],
)
def test_attention_rejects(
    batch: RandomBatch, override: Callable[[RandomBatch], dict], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        _attend(batch, **override(batch))


@pytest.mark.skipif(not interpreter_enabled(), reason="about the Triton interpreter")
def test_bf16_under_the_interpreter_is_refused_or_runs_on_torch() -> None:
    # the interpreter's bf16 tl.dot returned garbage (max error 8e8) with no error
    b = make_paged_batch(
        [20, 5], [3, 1], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=1,
        dtype=torch.bfloat16,
    )  # fmt: skip
    with pytest.raises(KernelDTypeError, match="bf16 attention needs a GPU"):
        _attend(b, backend="triton")
    auto = _attend(b, backend="auto")
    torch.testing.assert_close(auto, _attend(b, backend="torch"), rtol=0, atol=0)


def test_bad_backend_and_split_arguments_are_typed(batch: RandomBatch) -> None:
    with pytest.raises(KernelInputError, match="backend must be"):
        _attend(batch, backend="cuda")
    with pytest.raises(KernelInputError, match="not both"):
        _attend(batch, config=AttentionConfig(8, 16, 16), num_splits=2)


@pytest.mark.parametrize(("head_dim", "block_size"), [(96, 16), (64, 12), (64, 4)])
def test_unsupported_head_dim_and_block_size(head_dim: int, block_size: int) -> None:
    cache = torch.zeros(4, block_size, 1, head_dim)
    q = torch.zeros(1, 1, head_dim)
    with pytest.raises(UnsupportedConfigError, match=r"head_dim|block_size"):
        paged_attention(q, cache, cache, _i32(0)[None], _i32(1), _i32(0, 1))


def test_negative_padding_past_the_used_blocks_is_accepted(batch: RandomBatch) -> None:
    _attend(batch, block_tables=_table(batch, 1, 1, -1), backend="torch")


STORE_ERRORS: list[tuple[str, dict, type[Exception], str]] = [
    ("slot-range", {"slots": torch.tensor([0, 64])}, KernelInputError, r"slot_mapping\[1\] = 64"),
    ("slot-neg", {"slots": torch.tensor([-2, 0])}, KernelInputError, "not -1"),
    ("slot-float", {"slots": torch.tensor([0.0, 1.0])}, KernelDTypeError, "slot_mapping has"),
    ("k-shape", {"k": torch.zeros(3, 2, 64)}, KernelInputError, "k must be"),
    ("k-dtype", {"k": torch.zeros(2, 2, 64, dtype=torch.float16)}, KernelDTypeError, "cast it"),
    ("v-2d", {"v": torch.zeros(2, 128)}, KernelInputError, "v must be"),
    (
        "slot-strided",
        {"slots": torch.tensor([[0, 40], [1, 41]])[:, 0]},
        UnsupportedConfigError,
        r"slot_mapping\.contiguous\(\)",
    ),
]


@pytest.mark.parametrize(
    ("override", "error", "match"),
    [case[1:] for case in STORE_ERRORS],
    ids=[case[0] for case in STORE_ERRORS],
)
def test_store_rejects(override: dict, error: type, match: str) -> None:
    cache = torch.zeros(4, 16, 2, 64)
    args = {"k": torch.zeros(2, 2, 64), "v": torch.zeros(2, 2, 64), "slots": torch.tensor([0, 1])}
    args |= override
    with pytest.raises(error, match=match):
        store_kv(args["k"], args["v"], cache, cache.clone(), args["slots"])


def test_errors_are_builtin_subclasses() -> None:
    assert issubclass(KernelInputError, ValueError)
    assert issubclass(KernelDTypeError, TypeError)


def test_kernel_errors_are_library_errors() -> None:
    from prefixcache import PrefixCacheError

    for error in (
        KernelInputError,
        KernelDTypeError,
        UnsupportedConfigError,
        TritonUnavailableError,
    ):
        assert issubclass(error, PrefixCacheError)
    assert issubclass(UnsupportedConfigError, KernelInputError)


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(block_q=4, block_m=16, tile_n=24),
        AttentionConfig(block_q=9, block_m=16, tile_n=16),
        AttentionConfig(block_q=1, block_m=16, tile_n=16, num_splits=3),
    ],
    ids=["tile-not-pow2", "rows", "splits-not-pow2"],
)
def test_bad_config_rejected_on_torch_backend(batch: RandomBatch, config: AttentionConfig) -> None:
    """The torch backend ignores tile sizes but must still reject a config no kernel can run."""
    with pytest.raises(UnsupportedConfigError):
        _attend(batch, config=config, backend="torch")


def test_bad_config_rejected_before_an_empty_batch_returns(batch: RandomBatch) -> None:
    qsl = torch.zeros(1, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(UnsupportedConfigError):
        paged_attention(
            batch.q[:0],
            batch.k_cache,
            batch.v_cache,
            batch.block_tables[:0],
            empty,
            qsl,
            config=AttentionConfig(block_q=4, block_m=16, tile_n=24),
        )


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_attention_over_fp8_refuses_a_scale_that_is_not_positive(scale: float) -> None:
    from prefixcache.kernels.reference import quantize_fp8

    b = make_paged_batch([20], [1], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    k8, v8 = quantize_fp8(b.k_cache, 1.0), quantize_fp8(b.v_cache, 1.0)
    with pytest.raises(KernelInputError, match="k_scale and v_scale must be finite and > 0"):
        paged_attention(b.q, k8, v8, b.block_tables, b.seq_lens, b.query_start_loc, k_scale=scale)


@pytest.mark.parametrize(
    ("override", "error", "match"),
    [
        ({"lse": [0.0]}, KernelInputError, "lse must be a contiguous float32"),
        ({"config": "x"}, KernelInputError, "config must be an AttentionConfig"),
        (
            {"config": AttentionConfig(block_q=1.5, block_m=16, tile_n=16)},  # type: ignore[arg-type]
            UnsupportedConfigError,
            "block_q must be an int",
        ),
        ({"k_scale": -5.0}, KernelInputError, "finite and > 0"),  # ignored before, not fp8
        (
            {"k_cache": torch.zeros(4, 16, 0, 64), "v_cache": torch.zeros(4, 16, 0, 64)},
            KernelInputError,
            "0 KV heads",
        ),
    ],
    ids=["lse-list", "config-str", "config-float", "scale-non-fp8", "zero-kv-heads"],
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_more_bad_arguments_are_typed_errors_on_every_backend(
    batch: RandomBatch, override: dict, error: type, match: str, backend: str
) -> None:
    # these were AttributeError, ZeroDivisionError, an interpreter error, or silently accepted
    with pytest.raises(error, match=match):
        _attend(batch, backend=backend, **dict(override))


def test_an_empty_batch_still_refuses_a_backend_that_cannot_run(batch: RandomBatch) -> None:
    qsl, empty = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be"):
        paged_attention(
            batch.q[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0], empty, qsl,
            backend="cuda",  # type: ignore[arg-type]
        )  # fmt: skip
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="backend must be"):
        store_kv(
            torch.zeros(0, 2, 64), torch.zeros(0, 2, 64), cache, cache.clone(),
            torch.zeros(0, dtype=torch.int64), backend="cuda",  # type: ignore[arg-type]
        )  # fmt: skip


def test_explicit_groups_are_checked_without_validation(batch: RandomBatch) -> None:
    # with validate=False, sequence -1 wrapped to the last one and gave wrong output silently
    from prefixcache.kernels import PrefixGroup

    for groups in ([PrefixGroup((0, -1), 1)], [PrefixGroup((0.9, 1.7), 1)]):  # type: ignore[arg-type]
        with pytest.raises(KernelInputError, match="shared_prefix"):
            _attend(batch, shared_prefix=groups, validate=False)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_fp8_store_keeps_nan_a_nan(backend: str) -> None:
    # the Triton path stored NaN as -448 (0xfe); torch casts it to 0x7f
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    k = torch.full((1, 2, 64), float("nan"))
    store_kv(k, k.clone(), cache, cache.clone(), torch.tensor([0]), backend=backend)  # type: ignore[arg-type]
    assert int(cache[0, 0, 0, 0]) == 0x7F
