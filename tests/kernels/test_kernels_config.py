"""Launch-config heuristic (pure Python, no GPU needed) and backend dispatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixcache.kernels import (
    AttentionConfig,
    TritonUnavailableError,
    UnsupportedConfigError,
    choose_config,
    resolve_backend,
    triton_available,
)
from prefixcache.kernels.config import MAX_SPLITS, choose_split

H200_SMS = 132


def _cfg(num_seqs: int, total_q: int, max_seq_len: int, num_sms: int = H200_SMS, **kw: int):
    return choose_config(
        num_seqs=num_seqs,
        total_q=total_q,
        num_kv_heads=kw.pop("num_kv_heads", 8),
        group=kw.pop("group", 4),
        head_dim=kw.pop("head_dim", 128),
        max_seq_len=max_seq_len,
        num_sms=num_sms,
        **kw,
    )


def test_decode_uses_one_query_per_program() -> None:
    cfg = _cfg(64, 64, 4096)
    assert (cfg.block_q, cfg.block_m, cfg.num_splits) == (1, 16, 1)
    assert cfg.num_q_blocks(64, 64) == 64
    cfg.validate(group=4)


def test_extend_packs_query_tokens_times_group() -> None:
    cfg = _cfg(3, 40, 100, group=8)
    assert cfg.block_q * 8 == cfg.block_m and cfg.num_splits == 1
    assert cfg.num_q_blocks(40, 3) == 40 // cfg.block_q + 3
    cfg.validate(group=8)


def test_large_group_widens_rows() -> None:
    assert _cfg(2, 2, 100, group=32, num_kv_heads=1).block_m == 32


@pytest.mark.parametrize(
    ("num_seqs", "max_seq_len", "expected"),
    [
        (64, 4096, 1),  # 512 programs already fill the GPU
        (1, 131072, MAX_SPLITS),  # 8 programs, very long: as many splits as allowed
        (8, 4096, 8),  # 64 programs, 64 tiles: occupancy asks for 8 splits
        (2, 512, 8),  # 16 programs, 8 tiles: the length caps decode at 8 splits, a tile each
        (16, 1024, 4),  # 128 programs: occupancy asks for 4 splits of 4 tiles
        (2, 64, 1),  # a single tile: nothing to split
    ],
)
def test_split_heuristic(num_seqs: int, max_seq_len: int, expected: int) -> None:
    assert _cfg(num_seqs, num_seqs, max_seq_len).num_splits == expected


def test_extend_splits_keep_four_tiles_each() -> None:
    """Only decode splits down to one tile; extend programs keep MIN_TILES_PER_SPLIT."""
    assert _cfg(2, 16, 512).num_splits == 4  # 8 tokens each: 16 tiles of 32 keys, 4 a split
    assert _cfg(2, 2, 512).num_splits == 8  # decode, 8 tiles of 64 keys: one a split


def test_no_split_without_gpu_and_forced_split() -> None:
    assert choose_split(programs=1, max_seq_len=1 << 20, tile_n=64, num_sms=0) == 1
    assert _cfg(1, 1, 64, num_sms=0, num_splits=4).num_splits == 4


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(block_q=1, block_m=8, tile_n=16),
        AttentionConfig(block_q=1, block_m=16, tile_n=16, num_splits=64),
        AttentionConfig(block_q=0, block_m=16, tile_n=16),
        AttentionConfig(block_q=1, block_m=16, tile_n=16, num_splits=3),
    ],
)
def test_invalid_configs(config: AttentionConfig) -> None:
    with pytest.raises(ValueError):
        config.validate(group=4)


def test_backend_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu) == ("triton" if triton_available() else "torch")


def test_extend_with_long_prefix_and_few_programs_splits() -> None:
    assert _cfg(1, 64, 100_000, group=8).num_splits > 1


def test_without_triton_installed_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefixcache.kernels.backend as backend

    monkeypatch.setattr(backend, "triton_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(TritonUnavailableError, match="pip install"):
        resolve_backend("triton", torch.device("cpu"))


def test_import_does_not_need_triton() -> None:
    """`import prefixcache.kernels` and the torch path work where triton cannot be imported."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from prefixcache.kernels import paged_attention, store_kv\n"
        "from prefixcache.kernels.testing import make_paged_batch, contiguous_attention\n"
        "b = make_paged_batch([9], [2], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8)\n"
        "out = paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,\n"
        "                      b.query_start_loc, backend='torch')\n"
        "assert (out - contiguous_attention(b)).abs().max() < 1e-5\n"
        "assert 'triton' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


H200 = (9, 0)
A100 = (8, 0)


@pytest.mark.parametrize(
    ("capability", "head_dim", "group", "total_q", "expected_rows"),
    [
        (H200, 128, 4, 4096, 128),  # long prefill on Hopper: 128-row tiles
        (H200, 64, 8, 512, 128),
        (A100, 128, 4, 4096, 64),  # pre-Hopper keeps 64 rows
        (H200, 128, 4, 16, 64),  # 4 query tokens per sequence: mostly padding at 128 rows
        ((0, 0), 128, 4, 4096, 64),  # no GPU
    ],
    ids=["h200-prefill", "h200-d64", "a100", "h200-short-extend", "cpu"],
)
def test_hopper_tiles(
    capability: tuple[int, int], head_dim: int, group: int, total_q: int, expected_rows: int
) -> None:
    cfg = _cfg(4, total_q, 8192, head_dim=head_dim, group=group, capability=capability)
    assert cfg.block_m == expected_rows
    assert cfg.block_q * group == cfg.block_m
    if expected_rows == 128:
        assert (cfg.tile_n, cfg.num_warps, cfg.num_stages) == (64, 4, 3)
    cfg.validate(group)


def test_hopper_fp32_tiles_fit_two_stages() -> None:
    """fp32 tiles are twice as large: three pipeline stages would not fit in shared memory."""
    cfg = _cfg(4, 4096, 8192, capability=H200, elem_bytes=4)
    assert (cfg.block_m, cfg.tile_n, cfg.num_warps, cfg.num_stages) == (128, 64, 8, 2)


def test_store_config_is_a_pure_choice() -> None:
    from prefixcache.kernels.config import StoreConfig, choose_store_config

    assert choose_store_config(65536, 8, 128) == choose_store_config(65536, 8, 128)
    assert choose_store_config(1, 1, 64) == StoreConfig(32, 4)


def test_unmasked_tiles_flag_is_checked() -> None:
    AttentionConfig(1, 16, 16, unmasked_tiles=False).validate(group=4)
    with pytest.raises(UnsupportedConfigError, match="unmasked_tiles"):
        AttentionConfig(1, 16, 16, unmasked_tiles=1).validate(group=4)  # type: ignore[arg-type]


def test_hopper_decode_unchanged() -> None:
    """Decode stays one query per program whatever the GPU."""
    assert _cfg(64, 64, 4096, capability=H200) == _cfg(64, 64, 4096, capability=A100)


def test_hopper_large_group_keeps_group_rows() -> None:
    cfg = _cfg(1, 64, 4096, group=256, num_kv_heads=1, capability=H200)
    assert cfg.block_m == 256 and cfg.block_q == 1
    cfg.validate(256)


def test_choice_is_pure_and_cached_per_shape() -> None:
    from prefixcache.kernels.attention_launch import _cached_config

    kw = dict(num_seqs=3, total_q=300, num_kv_heads=8, group=4, head_dim=128, max_seq_len=9000)
    first = _cached_config(**kw, num_sms=132, capability=H200)
    hits = _cached_config.cache_info().hits
    assert _cached_config(**kw, num_sms=132, capability=H200) is first
    assert _cached_config.cache_info().hits == hits + 1
    assert choose_config(**kw, num_sms=132, capability=H200) == first
