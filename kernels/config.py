"""Launch configuration of the paged attention kernel and the heuristic that picks it.

No autotuning: the choice is a pure function of the batch shape, so it is cheap, deterministic and
testable without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.errors import UnsupportedConfigError

MAX_SPLITS = 32
HOPPER = (9, 0)
# Hopper-size tiles pay off only when a program's rows are mostly real queries.
MIN_ROWS_FOR_WIDE_TILE = 64
# A split should stream at least this many key tiles, or the merge costs more than it wins.
MIN_TILES_PER_SPLIT = 4
# Decode splits down to one tile: on an H200 that was as fast as two (1 x 1k-token decode:
# 14.6 us at 16 and 32 splits, 16.1 at 8, 20.2 at 4), since a program's keys are a chain of
# dependent tile loads, which costs more than the merge.
DECODE_MIN_TILES_PER_SPLIT = 1


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _prev_pow2(x: int) -> int:
    return 1 << (x.bit_length() - 1) if x > 0 else 0


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes of one launch.

    A program owns ``block_q`` query tokens times the ``group`` query heads that share one KV head,
    packed into ``block_m`` rows, and streams the keys ``tile_n`` at a time. ``num_splits > 1``
    splits every sequence's keys across programs (flash-decoding) and merges them afterwards.
    ``unmasked_tiles`` runs the key tiles that every row of a program sees in full (inside the
    sequence, at or before the causal diagonal) in a loop without masks; False masks every tile.
    """

    block_q: int
    block_m: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    unmasked_tiles: bool = True

    def validate(self, group: int) -> None:
        """Raise UnsupportedConfigError unless this config can run with ``group`` heads per KV."""
        check_num_splits(self.num_splits)
        for name in ("block_q", "block_m", "tile_n", "num_warps", "num_stages"):
            if type(getattr(self, name)) is not int:  # 1.5 or 16.0 would reach the kernel
                raise UnsupportedConfigError(f"{name} must be an int, got {self}")
        if type(self.unmasked_tiles) is not bool:
            raise UnsupportedConfigError(f"unmasked_tiles must be a bool, got {self}")
        for name in ("block_m", "tile_n", "num_warps"):
            if not _is_pow2(getattr(self, name)):
                raise UnsupportedConfigError(f"{name} must be a power of two, got {self}")
        if self.block_m < 16 or self.tile_n < 16:
            raise UnsupportedConfigError(f"block_m and tile_n must be >= 16 (tl.dot), got {self}")
        if self.block_q < 1 or self.block_q * group > self.block_m:
            raise UnsupportedConfigError(
                f"block_q * group ({self.block_q} * {group}) must be in [1, block_m={self.block_m}]"
            )
        if self.num_stages < 1:
            raise UnsupportedConfigError(f"num_stages must be >= 1, got {self}")

    def num_q_blocks(self, total_q: int, num_seqs: int) -> int:
        """Grid size along queries; matches the kernel's sequence lookup (see the kernel)."""
        return total_q if self.block_q == 1 else total_q // self.block_q + num_seqs


def check_num_splits(num_splits: object) -> None:
    """UnsupportedConfigError unless ``num_splits`` is a power of two in [1, MAX_SPLITS]."""
    if (
        type(num_splits) is not int
        or not 1 <= num_splits <= MAX_SPLITS
        or num_splits & (num_splits - 1)
    ):
        raise UnsupportedConfigError(
            f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits!r}"
        )


def choose_split(
    programs: int,
    max_seq_len: int,
    tile_n: int,
    num_sms: int,
    min_tiles: int = MIN_TILES_PER_SPLIT,
) -> int:
    """KV splits so that ``programs * splits`` fills about two waves of ``num_sms``.

    Splitting only pays when the grid is too small for the GPU and every split still streams
    ``min_tiles`` tiles; ``num_sms <= 0`` (no GPU) never splits.
    """
    if num_sms <= 0 or programs >= num_sms:
        return 1
    by_length = _prev_pow2(-(-max_seq_len // tile_n) // min_tiles)
    by_occupancy = _next_pow2(-(-2 * num_sms // programs))
    splits = min(by_length, by_occupancy, MAX_SPLITS)
    return splits if splits >= 2 else 1


def choose_config(
    *,
    num_seqs: int,
    total_q: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_seq_len: int,
    num_sms: int,
    num_splits: int | None = None,
    capability: tuple[int, int] = (0, 0),
    elem_bytes: int = 2,
) -> AttentionConfig:
    """Heuristic launch config for one batch; ``num_splits`` forces the split count.

    ``capability`` is the GPU's compute capability ((0, 0) without a GPU); ``elem_bytes`` the
    size of a query element (4 for fp32). On Hopper (sm_90+) extend/prefill batches whose
    sequences average at least MIN_ROWS_FOR_WIDE_TILE rows (query tokens x group) get 128-row
    tiles with 64-key tiles (head_dim <= 128): twice the rows per K/V tile, which the larger
    register file and shared memory hold. 16-bit inputs run them with 4 warps and 3 pipeline
    stages (on an H200, 1 x (16k cached + 2k new): 331 TFLOP/s, against 263 with 8 warps and 2
    stages, the best of 27 configs); fp32, whose three stages would not fit in shared memory,
    with 8 warps and 2.
    """
    group_rows = _next_pow2(group)
    num_warps, num_stages = 4, 2
    if total_q == num_seqs:
        # Pure decode: one query token per program, wider key tiles since it is bandwidth bound.
        block_m, block_q, tile_n = max(16, group_rows), 1, 64
    elif (
        capability >= HOPPER
        and head_dim <= 128
        and group_rows <= 128
        and total_q * group >= MIN_ROWS_FOR_WIDE_TILE * num_seqs
    ):
        block_m, tile_n = 128, 64
        num_warps, num_stages = (4, 3) if elem_bytes <= 2 else (8, 2)
        block_q = block_m // group
    else:
        block_m = max(64, group_rows)
        block_q = block_m // group
        tile_n = 64 if head_dim <= 64 else 32
    cfg = AttentionConfig(block_q=block_q, block_m=block_m, tile_n=tile_n, num_warps=num_warps)
    programs = cfg.num_q_blocks(total_q, num_seqs) * num_kv_heads
    min_tiles = DECODE_MIN_TILES_PER_SPLIT if total_q == num_seqs else MIN_TILES_PER_SPLIT
    splits = (
        choose_split(programs, max_seq_len, tile_n, num_sms, min_tiles)
        if num_splits is None
        else num_splits
    )
    return AttentionConfig(
        block_q=block_q,
        block_m=block_m,
        tile_n=tile_n,
        num_splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@dataclass(frozen=True)
class StoreConfig:
    """Launch configuration of ``store_kv``: ``block_t`` tokens of one KV head per program."""

    block_t: int = 32
    num_warps: int = 4


def choose_store_config(num_tokens: int, num_kv_heads: int, head_dim: int) -> StoreConfig:
    """Heuristic ``store_kv`` launch config for a batch of ``num_tokens`` new tokens."""
    del num_tokens, num_kv_heads, head_dim  # one config serves every shape measured so far
    return StoreConfig()
