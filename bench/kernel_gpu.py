"""GPU check of the paged attention kernels: tests on CUDA, then a decode bandwidth benchmark.

    python bench/kernel_gpu.py [--skip-tests] [--skip-bench] [--quick]

(a) runs tests/test_kernels*.py compiled on the GPU (bf16 cases included);
(b) times decode attention over paged K/V (shuffled physical blocks) for batch x context grids and
    compares it with the same kernel over sequential blocks and with torch SDPA over contiguous
    K/V. Bandwidth counts K and V bytes read once; the peak is the H200's ~4.8 TB/s;
(c) shared-prefix decode: 64 sequences x (8k shared + 256 own tokens), cascade (prefix read once)
    against the per-sequence path;
(d) small-batch decode, eager launches against one CUDA graph replay (out=, workspace=,
    validate=False), each with its ratio to SDPA, for B = 1, 16, 64 x 1k..128k tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# Compiled kernels, not the interpreter: triton.jit reads this when the kernels are imported, and
# tests/conftest.py only sets it when unset.
os.environ["TRITON_INTERPRET"] = "0"

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
PEAK_TBPS = 4.8
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
GRID = [
    (1, 32768),
    (8, 8192),
    (16, 4096),
    (32, 4096),
    (64, 1024),
    (64, 4096),
    (64, 16384),
    (128, 4096),
    (256, 2048),
]
QUICK_GRID = [(8, 4096), (64, 4096)]


def run_tests() -> int:
    import pytest

    files = sorted(str(p) for p in (ROOT / "tests").glob("test_kernels*.py"))
    print(f"== kernel tests on {torch.cuda.get_device_name()} ({len(files)} files)", flush=True)
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *files]))


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    shuffled: torch.Tensor  # [B, blocks_per_seq] int32, random physical ids
    sequential: torch.Tensor  # [B, blocks_per_seq] int32, ids in order (contiguous memory)
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context: int


def make_case(batch: int, context: int) -> DecodeCase:
    blocks = context // BLOCK_SIZE
    num_blocks = batch * blocks
    dev = "cuda"
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return DecodeCase(
        q=torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=dev, dtype=DTYPE),
        k_cache=torch.randn(cache_shape, device=dev, dtype=DTYPE),
        v_cache=torch.randn(cache_shape, device=dev, dtype=DTYPE),
        shuffled=torch.randperm(num_blocks, device=dev).view(batch, blocks).int(),
        sequential=torch.arange(num_blocks, device=dev).view(batch, blocks).int(),
        seq_lens=torch.full((batch,), context, device=dev, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, device=dev, dtype=torch.int32),
        context=context,
    )


def contiguous_kv(case: DecodeCase, cache: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, context, D] copy of the cache in the shuffled tables' order, for SDPA."""
    batch, blocks = case.shuffled.shape
    gathered = cache[case.shuffled.long()]  # [B, blocks, BLOCK_SIZE, Hkv, D]
    tokens = gathered.view(batch, blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return tokens.transpose(1, 2).contiguous()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode attention with torch SDPA; q [B, Hq, D], k/v [B, Hkv, T, D] -> [B, Hq, D]."""
    q4 = q.unsqueeze(2)
    try:
        out = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: expand the KV heads
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q4, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        )
    return out.squeeze(2)


def paged(case: DecodeCase, table: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Decode through the public wrapper, without the host-side checks (no GPU sync)."""
    from prefixcache.kernels import paged_attention

    return paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        table,
        case.seq_lens,
        case.query_start_loc,
        max_seq_len=case.context,
        num_splits=splits,
        validate=False,
    )


def bench(grid: list[tuple[int, int]]) -> None:
    from triton.testing import do_bench

    from prefixcache.kernels import choose_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"\n== decode: Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE} "
        f"block={BLOCK_SIZE}, {sms} SMs, peak {PEAK_TBPS} TB/s"
    )
    print(
        f"{'batch':>5} {'ctx':>6} {'split':>5} {'paged us':>9} {'TB/s':>5} {'%peak':>5} "
        f"{'seq-blk us':>10} {'nosplit us':>10} {'sdpa us':>8} {'vs sdpa':>7} "
        f"{'maxdiff':>8}"
    )
    for batch, context in grid:
        case = make_case(batch, context)
        cfg = choose_config(
            num_seqs=batch,
            total_q=batch,
            num_kv_heads=NUM_KV_HEADS,
            group=NUM_Q_HEADS // NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            max_seq_len=context,
            num_sms=sms,
        )
        k, v = contiguous_kv(case, case.k_cache), contiguous_kv(case, case.v_cache)
        t_paged = do_bench(partial(paged, case, case.shuffled)) * 1e3
        t_seq = do_bench(partial(paged, case, case.sequential)) * 1e3
        t_nosplit = t_paged
        if cfg.num_splits > 1:
            t_nosplit = do_bench(partial(paged, case, case.shuffled, 1)) * 1e3
        t_sdpa = do_bench(partial(sdpa, case.q, k, v)) * 1e3
        diff = (paged(case, case.shuffled).float() - sdpa(case.q, k, v).float()).abs().max()
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * case.k_cache.element_size()
        tbps = kv_bytes / (t_paged * 1e-6) / 1e12
        print(
            f"{batch:>5} {context:>6} {cfg.num_splits:>5} {t_paged:>9.1f} {tbps:>5.2f} "
            f"{100 * tbps / PEAK_TBPS:>5.1f} {t_seq:>10.1f} {t_nosplit:>10.1f} {t_sdpa:>8.1f} "
            f"{t_paged / t_sdpa:>6.2f}x {diff.item():>8.1e}",
            flush=True,
        )
        del case, k, v
        torch.cuda.empty_cache()
    print("\nseq-blk: same kernel over in-order blocks (paging overhead = paged / seq-blk);")
    print("nosplit: split-KV forced off; vs sdpa: paged time / SDPA time over contiguous K/V.")


def bench_shared_prefix(batch: int = 64, shared: int = 8192, own: int = 256) -> None:
    """Decode over a common prefix: per-sequence reads vs the prefix read once per group."""
    from triton.testing import do_bench

    from prefixcache.kernels import PrefixGroup, paged_attention

    print(f"\n== shared prefix: {batch} x ({shared} shared + {own} own) tokens, decode")
    dev = "cuda"
    shared_blocks, own_blocks = shared // BLOCK_SIZE, own // BLOCK_SIZE
    num_blocks = shared_blocks + batch * own_blocks
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=dev, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device=dev, dtype=DTYPE)
    prefix = torch.arange(shared_blocks, device=dev).expand(batch, -1)
    private = shared_blocks + torch.randperm(batch * own_blocks, device=dev).view(batch, own_blocks)
    tables = torch.cat([prefix, private], 1).int()
    seq_lens = torch.full((batch,), shared + own, device=dev, dtype=torch.int32)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl)
    groups = [PrefixGroup(tuple(range(batch)), shared_blocks)]

    def run(mode: Any) -> torch.Tensor:
        return paged_attention(*args, shared_prefix=mode, validate=False)

    t_plain = do_bench(partial(run, None)) * 1e3
    t_auto = do_bench(partial(run, "auto")) * 1e3
    t_groups = do_bench(partial(run, groups)) * 1e3
    diff = (run("auto").float() - run(None).float()).abs().max().item()
    kv_row = 2 * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    plain_gb, cascade_gb = (
        batch * (shared + own) * kv_row / 1e9,
        (shared + batch * own) * kv_row / 1e9,
    )
    print(f"{'path':>22} {'us':>9} {'K/V GB read':>11} {'vs plain':>8}")
    print(f"{'per-sequence':>22} {t_plain:>9.1f} {plain_gb:>11.3f} {1.0:>7.2f}x")
    speedup = t_plain / t_auto
    print(f"{'cascade (auto groups)':>22} {t_auto:>9.1f} {cascade_gb:>11.3f} {speedup:>7.2f}x")
    print(
        f"{'cascade (given groups)':>22} {t_groups:>9.1f} {cascade_gb:>11.3f} "
        f"{t_plain / t_groups:>7.2f}x"
    )
    print(f"max |cascade - plain| = {diff:.1e}; auto includes planning (reads the tables on host)")


SMALL_BATCH_GRID = [(b, c) for b in (1, 16, 64) for c in (1024, 8192, 32768, 131072)]
MAX_TOKENS = 1 << 22  # skip shapes whose cache plus SDPA copy would not fit comfortably


def bench_graphs(grid: list[tuple[int, int]]) -> None:
    """Small-batch decode: eager wrapper calls vs one captured CUDA graph, both against SDPA."""
    from triton.testing import do_bench

    from prefixcache.kernels import paged_attention, workspace_size

    print("\n== decode launch overhead: eager vs CUDA graph (out=, workspace=, validate=False)")
    print(
        f"{'batch':>5} {'ctx':>6} {'eager us':>9} {'graph us':>9} {'sdpa us':>8} "
        f"{'eager/sdpa':>10} {'graph/sdpa':>10}"
    )
    for batch, context in grid:
        if batch * context > MAX_TOKENS:
            print(f"{batch:>5} {context:>6}  skipped (> {MAX_TOKENS} tokens)")
            continue
        case = make_case(batch, context)
        out = torch.empty_like(case.q)
        ws = torch.empty(workspace_size(batch, NUM_Q_HEADS, HEAD_DIM), device="cuda")
        args = (
            case.q,
            case.k_cache,
            case.v_cache,
            case.shuffled,
            case.seq_lens,
            case.query_start_loc,
        )

        step = partial(
            paged_attention, *args, out=out, workspace=ws, max_seq_len=context, validate=False
        )

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        k, v = contiguous_kv(case, case.k_cache), contiguous_kv(case, case.v_cache)
        t_eager = do_bench(step) * 1e3
        t_graph = do_bench(graph.replay) * 1e3
        t_sdpa = do_bench(partial(sdpa, case.q, k, v)) * 1e3
        print(
            f"{batch:>5} {context:>6} {t_eager:>9.1f} {t_graph:>9.1f} {t_sdpa:>8.1f} "
            f"{t_eager / t_sdpa:>9.2f}x {t_graph / t_sdpa:>9.2f}x",
            flush=True,
        )
        del case, k, v, graph
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--quick", action="store_true", help="two benchmark shapes only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs an NVIDIA GPU (nothing was run)", file=sys.stderr)
        return 1
    status = 0 if args.skip_tests else run_tests()
    if not args.skip_bench:
        bench(QUICK_GRID if args.quick else GRID)
        bench_shared_prefix()
        bench_graphs(SMALL_BATCH_GRID[:2] if args.quick else SMALL_BATCH_GRID)
    return status


if __name__ == "__main__":
    sys.exit(main())
