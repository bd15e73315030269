"""The lean launch path: preallocated out/workspace, no host sync, no allocation, graph capture.

The no-sync/no-allocation guarantee is checked by swapping the jitted kernels for recorders and
making every allocator and host read of torch raise while the wrappers run; the results of the
real kernels with preallocated buffers are compared with the default path separately.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import prefixcache.kernels.attention as attention_mod
import prefixcache.kernels.attention_launch as launch_mod
import prefixcache.kernels.store as store_mod
from prefixcache.kernels import (
    AttentionConfig,
    KernelInputError,
    interpreter_enabled,
    paged_attention,
    store_kv,
    workspace_size,
)
from prefixcache.kernels.config import MAX_SPLITS
from prefixcache.kernels.testing import RandomBatch, contiguous_attention, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"


def _batch(seed: int = 0, dtype: torch.dtype = torch.float32) -> RandomBatch:
    return make_paged_batch(
        [37, 9, 20],
        [1, 1, 4],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        dtype=dtype,
        device=DEVICE,
        shared_prefix_blocks=1,
        seed=seed,
    )


def _args(b: RandomBatch) -> tuple[torch.Tensor, ...]:
    return (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc)


def _workspace(b: RandomBatch) -> torch.Tensor:
    n = workspace_size(b.q.shape[0], b.q.shape[1], b.q.shape[2], MAX_SPLITS)
    return torch.empty(n, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_preallocated_out_and_workspace_give_identical_results(num_splits: int) -> None:
    b = _batch()
    expected = paged_attention(*_args(b), num_splits=num_splits)
    out, lse = torch.full_like(b.q, float("nan")), torch.empty(b.q.shape[:2], device=DEVICE)
    got = paged_attention(
        *_args(b), out=out, lse=lse, workspace=_workspace(b), num_splits=num_splits, validate=False
    )
    assert got is out
    assert torch.equal(out, expected)
    ref_lse = torch.empty_like(lse)
    paged_attention(*_args(b), lse=ref_lse, backend="torch")
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_workspace_too_small_or_wrong_dtype() -> None:
    b = _batch()
    for ws in (torch.empty(10, device=DEVICE), torch.empty(10**6, dtype=torch.float16)):
        with pytest.raises(KernelInputError, match="workspace"):
            paged_attention(*_args(b), workspace=ws, num_splits=2, validate=False)


def test_hopper_size_tile_runs() -> None:
    """The 128-row config the heuristic picks on Hopper, exact in the interpreter."""
    b = make_paged_batch(
        [70, 41], [40, 33], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=4
    )
    cfg = AttentionConfig(block_q=32, block_m=128, tile_n=64, num_warps=8)
    out = paged_attention(*_args(b), config=cfg)
    torch.testing.assert_close(out, contiguous_attention(b), atol=1e-5, rtol=1e-5)


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](**args)`` records the launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def run(**kwargs: Any) -> None:
            self.launches.append((grid, kwargs))

        return run


def _boom(what: str):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} on the hot path")

    return fail


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    import prefixcache.kernels.triton_attention as ta
    import prefixcache.kernels.triton_store as ts

    recs = {name: _Recorder() for name in ("attn", "merge", "store")}
    monkeypatch.setattr(ta, "paged_attention_kernel", recs["attn"])
    monkeypatch.setattr(ta, "merge_splits_kernel", recs["merge"])
    monkeypatch.setattr(ts, "store_kv_kernel", recs["store"])
    monkeypatch.setattr(launch_mod, "check_kernel_mode", lambda *a: None)
    monkeypatch.setattr(store_mod, "check_kernel_mode", lambda *a: None)
    monkeypatch.setattr(attention_mod, "resolve_backend", lambda *a: "triton")
    monkeypatch.setattr(store_mod, "resolve_backend", lambda *a: "triton")
    return recs


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A context manager under which torch allocation and host reads of tensors raise."""
    from contextlib import contextmanager

    @contextmanager
    def guarded() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            for name in ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like"):
                mp.setattr(torch, name, _boom(f"torch.{name}"))
            for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__"):
                mp.setattr(torch.Tensor, name, _boom(f"Tensor.{name}"))
            for name in ("clone", "contiguous", "new_empty"):
                mp.setattr(torch.Tensor, name, _boom(f"Tensor.{name}"))
            yield

    yield guarded


def test_hot_path_does_not_sync_or_allocate(recorders: dict[str, _Recorder], guard: Any) -> None:
    b = _batch()
    out, ws = torch.empty_like(b.q), _workspace(b)
    k, v = b.keys[2][-4:].contiguous(), b.values[2][-4:].contiguous()
    slots = b.slot_mapping(2)[-4:].contiguous()
    with guard():
        paged_attention(*_args(b), out=out, workspace=ws, num_splits=4, validate=False)
        paged_attention(*_args(b), out=out, workspace=ws, validate=False)  # heuristic config
        store_kv(k, v, b.k_cache, b.v_cache, slots, validate=False)
    assert [len(r.launches) for r in recorders.values()] == [2, 1, 1]
    (grid, kw), _ = recorders["attn"].launches
    assert grid[2] == 4 and kw["SPLIT"] and kw["seg_out_ptr"].data_ptr() == ws.data_ptr()


def test_guard_catches_allocation_and_sync(recorders: dict[str, _Recorder], guard: Any) -> None:
    """The guard is not vacuous: the default paths allocate or read values on the host."""
    b = _batch()
    with guard(), pytest.raises(AssertionError, match="on the hot path"):
        paged_attention(*_args(b), validate=False)  # allocates out
    with guard(), pytest.raises(AssertionError, match="on the hot path"):
        paged_attention(*_args(b), out=torch.empty_like(b.q))  # validates: reads seq_lens
    out = torch.empty_like(b.q)
    with guard(), pytest.raises(AssertionError, match="on the hot path"):
        paged_attention(*_args(b), out=out, num_splits=2, validate=False)  # split buffers


@pytest.mark.skipif(
    not torch.cuda.is_available() or interpreter_enabled(),
    reason="CUDA graph capture needs a CUDA device and compiled kernels (TRITON_INTERPRET unset)",
)
def test_cuda_graph_capture_and_replay_with_new_tables_and_lengths() -> None:
    hq, hkv, d, p, batch, max_blocks = 8, 2, 128, 16, 4, 8
    dtype = torch.float16
    num_blocks = batch * max_blocks + 1
    k_cache = torch.randn(num_blocks, p, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ws = torch.empty(workspace_size(batch, hq, d), device="cuda")
    static = (q, k_cache, v_cache, tables, seq_lens, qsl)

    def step() -> None:
        paged_attention(*static, out=out, workspace=ws, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * max_blocks] + 1
        tables.copy_(perm.view(batch, max_blocks).to(torch.int32))
        seq_lens.copy_(torch.randint(1, p * max_blocks + 1, (batch,), generator=gen))
        q.copy_(torch.randn(batch, hq, d, generator=gen).to(dtype))
        graph.replay()
        expected = paged_attention(*static, backend="torch")
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-3, rtol=3e-3)
