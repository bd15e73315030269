"""GPU check of the paged attention kernels: tests on CUDA, then the kernel benchmarks.

    python bench/kernel_gpu.py [--skip-tests] [--skip-bench] [--quick] [--smoke]
                               [--parts decode,shared,...] [--json FILE]

(a) runs tests/kernels/test_kernels*.py compiled on the GPU (bf16 cases included);
(b) times decode attention over paged K/V (shuffled physical blocks) for batch x context grids and
    compares it with the same kernel over sequential blocks and with torch SDPA over contiguous
    K/V. Bandwidth counts K and V bytes read once; the peak is the H200's ~4.8 TB/s;
(c) shared-prefix decode: 64 sequences x (8k shared + 256 own tokens), cascade (prefix read once;
    groups found, given, or a plan made once) against the per-sequence path, eager and as graphs;
(d) small-batch decode, eager launches (back to back) against one CUDA graph replay (out=,
    workspace=, validate=False), each against SDPA timed the same way, for B = 1, 16, 64 x
    1k..128k tokens;
(e) extend (prefill over cached K/V): attention TFLOP/s against a dense matmul timed in the same
    run, SDPA with a bottom-right causal mask beside it, and the extend tile configs around the
    heuristic's choice on the long case;
(f) fp8 (e4m3, per-tensor scales) against 16-bit K/V for large-batch decode: time, speed-up and
    max |error| of each against an fp32 reference;
(g) store_kv of 1k, 64k and 256k tokens: checked, unchecked and CUDA-graph launches;
(h) config sweeps, each launch replayed from a CUDA graph (kernel time): KV splits for small
    batches (``splits``), decode tiles and pipeline depth (``decode-configs``), the same for fp8
    K/V (``fp8-configs``) and store_kv's tokens per program and warps (``store-configs``).

Bandwidths are also given as a share of a device-to-device copy timed in the same run (bytes read
plus written), the HBM ceiling the kernels can reach. ``--parts`` picks parts (default: all, in
the order above); ``--json FILE`` appends one JSON line per measured row.

``--smoke`` runs every part with tiny shapes on the CPU through the Triton interpreter (a single
timed call each, no CUDA graphs), so the script is known to run before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# Compiled kernels, not the interpreter (the interpreter for a smoke run on the CPU): triton.jit
# reads this when the kernels are imported, and tests/conftest.py only sets it when unset.
os.environ["TRITON_INTERPRET"] = "1" if "--smoke" in sys.argv[1:] else "0"

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
PEAK_TBPS = 4.8
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"
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
EXTEND_CASES = [(8, 4096, 512), (1, 16384, 2048), (4, 0, 4096)]  # (batch, cached, new) each
FP8_GRID = [(64, 4096), (128, 4096), (256, 2048), (64, 16384)]
STORE_TOKENS = [1024, 65536, 262144]
PARTS = (
    "decode",
    "shared",
    "graphs",
    "extend",
    "fp8",
    "store",
    "splits",
    "decode-configs",
    "fp8-configs",
    "store-configs",
)
JSON_PATH: Path | None = None
WARM = False  # --warm: run every launch once, untimed, to fill Triton's compile cache
COPY_TBPS = math.nan  # device-to-device copy bandwidth measured in this run


def record(part: str, **fields: Any) -> None:
    """Append one measured row to the ``--json`` file (when given)."""
    if JSON_PATH is not None:
        with JSON_PATH.open("a") as f:
            f.write(json.dumps({"part": part, **fields}) + "\n")


def timer(fn: Callable[[], Any], rep: int = 100) -> float:
    """Median microseconds per call: triton's do_bench on the GPU (``rep`` ms of repeats, L2
    flushed between calls); one timed call in a smoke run; one untimed call (NaN) with --warm."""
    if WARM:
        fn()
        return math.nan
    if DEV == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def loop_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """Median microseconds per call over runs of ``calls`` back-to-back calls, as a serving loop
    makes them (no cache flush in between): what an eager call costs when its host work, not
    the GPU, is the bound. One call (timer) in a smoke or --warm run."""
    if WARM or DEV != "cuda":
        return timer(fn)
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(runs)[len(runs) // 2]


def copy_tbps(nbytes: int = 1 << 31) -> float:
    """TB/s of a device-to-device copy of ``nbytes`` (bytes read plus written): the HBM ceiling."""
    src = torch.randn(nbytes // 2, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = timer(partial(dst.copy_, src))
    del src, dst
    release()
    return 2 * nbytes / (t * 1e-6) / 1e12


def release() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def num_sms() -> int:
    from prefixcache.kernels.attention_launch import device_num_sms

    return device_num_sms(torch.device(DEV))


def model_config(num_seqs: int, total_q: int, max_seq_len: int, sms: int, **extra: Any) -> Any:
    """The launch heuristic's choice for this script's model heads (``extra``: capability,
    elem_bytes, ...)."""
    from prefixcache.kernels import choose_config

    return choose_config(
        num_seqs=num_seqs,
        total_q=total_q,
        num_kv_heads=NUM_KV_HEADS,
        group=NUM_Q_HEADS // NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_seq_len=max_seq_len,
        num_sms=sms,
        **extra,
    )


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=DTYPE)


def run_tests() -> int:
    import pytest

    files = sorted(str(p) for p in (ROOT / "tests" / "kernels").glob("test_kernels*.py"))
    name = torch.cuda.get_device_name() if DEV == "cuda" else "the CPU (interpreter)"
    print(f"== kernel tests on {name} ({len(files)} files)", flush=True)
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
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return DecodeCase(
        q=randn(batch, NUM_Q_HEADS, HEAD_DIM),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        shuffled=torch.randperm(num_blocks, device=DEV).view(batch, blocks).int(),
        sequential=torch.arange(num_blocks, device=DEV).view(batch, blocks).int(),
        seq_lens=torch.full((batch,), context, device=DEV, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, device=DEV, dtype=torch.int32),
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

    sms = num_sms()
    print(
        f"\n== decode: Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE} "
        f"block={BLOCK_SIZE}, {sms} SMs, peak {PEAK_TBPS} TB/s, copy {COPY_TBPS:.2f} TB/s"
    )
    print(
        f"{'batch':>5} {'ctx':>6} {'split':>5} {'paged us':>9} {'TB/s':>5} {'%peak':>5} "
        f"{'%copy':>5} {'seq-blk us':>10} {'nosplit us':>10} {'sdpa us':>8} {'vs sdpa':>7} "
        f"{'maxdiff':>8}"
    )
    for batch, context in grid:
        case = make_case(batch, context)
        cfg = model_config(
            batch,
            batch,
            context,
            sms,
        )
        k, v = contiguous_kv(case, case.k_cache), contiguous_kv(case, case.v_cache)
        t_paged = timer(partial(paged, case, case.shuffled))
        t_seq = timer(partial(paged, case, case.sequential))
        t_nosplit = t_paged
        if cfg.num_splits > 1:
            t_nosplit = timer(partial(paged, case, case.shuffled, 1))
        t_sdpa = timer(partial(sdpa, case.q, k, v))
        diff = (paged(case, case.shuffled).float() - sdpa(case.q, k, v).float()).abs().max()
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * case.k_cache.element_size()
        tbps = kv_bytes / (t_paged * 1e-6) / 1e12
        print(
            f"{batch:>5} {context:>6} {cfg.num_splits:>5} {t_paged:>9.1f} {tbps:>5.2f} "
            f"{100 * tbps / PEAK_TBPS:>5.1f} {100 * tbps / COPY_TBPS:>5.1f} {t_seq:>10.1f} "
            f"{t_nosplit:>10.1f} {t_sdpa:>8.1f} {t_paged / t_sdpa:>6.2f}x {diff.item():>8.1e}",
            flush=True,
        )
        record(
            "decode",
            batch=batch,
            context=context,
            splits=cfg.num_splits,
            paged_us=t_paged,
            tbps=tbps,
            seq_blocks_us=t_seq,
            nosplit_us=t_nosplit,
            sdpa_us=t_sdpa,
            maxdiff=diff.item(),
        )
        del case, k, v
        release()
    print("\nseq-blk: same kernel over in-order blocks (paging overhead = paged / seq-blk);")
    print("nosplit: split-KV forced off; vs sdpa: paged time / SDPA time over contiguous K/V.")


def bench_shared_prefix(batch: int = 64, shared: int = 8192, own: int = 256) -> None:
    """Decode over a common prefix: per-sequence reads vs the prefix read once per group."""
    from prefixcache.kernels import PrefixGroup, paged_attention, plan_shared_prefix

    print(f"\n== shared prefix: {batch} x ({shared} shared + {own} own) tokens, decode")
    dev = DEV
    shared_blocks, own_blocks = shared // BLOCK_SIZE, own // BLOCK_SIZE
    num_blocks = shared_blocks + batch * own_blocks
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    prefix = torch.arange(shared_blocks, device=dev).expand(batch, -1)
    private = shared_blocks + torch.randperm(batch * own_blocks, device=dev).view(batch, own_blocks)
    tables = torch.cat([prefix, private], 1).int()
    seq_lens = torch.full((batch,), shared + own, device=dev, dtype=torch.int32)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = randn(batch, NUM_Q_HEADS, HEAD_DIM)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl)
    groups = [PrefixGroup(tuple(range(batch)), shared_blocks)]

    def run(mode: Any) -> torch.Tensor:
        return paged_attention(*args, shared_prefix=mode, validate=False)

    plan = plan_shared_prefix(tables, seq_lens, qsl, block_size=BLOCK_SIZE, groups=groups)
    t_plain = timer(partial(run, None))
    t_auto = timer(partial(run, "auto"))
    t_groups = timer(partial(run, groups))
    t_plan = timer(partial(run, plan))
    t_plain_graph = timer(capture(partial(run, None)).replay) if DEV == "cuda" else math.nan
    t_plan_graph = timer(capture(partial(run, plan)).replay) if DEV == "cuda" else math.nan
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
    ratio = t_plain / t_plan
    print(f"{'cascade (plan reused)':>22} {t_plan:>9.1f} {cascade_gb:>11.3f} {ratio:>7.2f}x")
    print(f"{'per-sequence, graph':>22} {t_plain_graph:>9.1f} {plain_gb:>11.3f}")
    print(
        f"{'cascade plan, graph':>22} {t_plan_graph:>9.1f} {cascade_gb:>11.3f} "
        f"{t_plain_graph / t_plan_graph:>7.2f}x"
    )
    print(f"max |cascade - plain| = {diff:.1e}; auto includes planning (reads the tables on host)")
    record(
        "shared",
        batch=batch,
        shared=shared,
        own=own,
        plain_us=t_plain,
        auto_us=t_auto,
        groups_us=t_groups,
        plan_us=t_plan,
        plain_graph_us=t_plain_graph,
        plan_graph_us=t_plan_graph,
        plain_gb=plain_gb,
        cascade_gb=cascade_gb,
        maxdiff=diff,
    )


SMALL_BATCH_GRID = [(b, c) for b in (1, 16, 64) for c in (1024, 8192, 32768, 131072)]
MAX_TOKENS = 1 << 22  # skip shapes whose cache plus SDPA copy would not fit comfortably


def bench_graphs(grid: list[tuple[int, int]]) -> None:
    """Small-batch decode: eager wrapper calls vs one captured CUDA graph, both against SDPA.

    ``launch us`` calls the Triton launch behind the wrapper directly (no argument checks), so
    eager minus launch is the wrapper's own cost. Eager calls (and SDPA's) are timed back to back
    (``loop_us``), graph replays one at a time with the L2 flushed (``timer``).
    """
    from prefixcache.kernels import PagedBatch, paged_attention, workspace_size
    from prefixcache.kernels.attention_launch import choose_launch_config, launch_attention
    from prefixcache.kernels.validation import check_attention_args

    print("\n== decode launch overhead: eager vs CUDA graph (out=, workspace=, validate=False)")
    print(
        f"{'batch':>5} {'ctx':>6} {'split':>5} {'eager us':>9} {'launch us':>9} {'graph us':>9} "
        f"{'sdpa us':>8} {'sdpa graph':>10} {'eager/sdpa':>10} {'graph/sdpa graph':>16}"
    )
    for batch, context in grid:
        if batch * context > MAX_TOKENS:
            print(f"{batch:>5} {context:>6}  skipped (> {MAX_TOKENS} tokens)")
            continue
        case = make_case(batch, context)
        out = torch.empty_like(case.q)
        ws = torch.empty(workspace_size(batch, NUM_Q_HEADS, HEAD_DIM), device=DEV)
        args = PagedBatch(
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
        shapes = check_attention_args(args, out)
        cfg = choose_launch_config(shapes, case.q.device, context, None)
        launch = partial(
            launch_attention,
            args,
            out=out,
            lse=None,
            shapes=shapes,
            cfg=cfg,
            workspace=ws,
            qk_scale=HEAD_DIM**-0.5 * 1.4426950408889634,
            v_scale=1.0,
            fp8=False,
        )

        k, v = contiguous_kv(case, case.k_cache), contiguous_kv(case, case.v_cache)
        t_eager = loop_us(step)
        t_launch = loop_us(launch)
        run_sdpa = partial(sdpa, case.q, k, v)
        t_sdpa = loop_us(run_sdpa)
        t_graph = t_sdpa_graph = math.nan
        if DEV == "cuda":
            t_graph = timer(capture(step).replay)
            t_sdpa_graph = timer(capture(run_sdpa).replay)
        print(
            f"{batch:>5} {context:>6} {cfg.num_splits:>5} {t_eager:>9.1f} {t_launch:>9.1f} "
            f"{t_graph:>9.1f} {t_sdpa:>8.1f} {t_sdpa_graph:>10.1f} {t_eager / t_sdpa:>9.2f}x "
            f"{t_graph / t_sdpa_graph:>15.2f}x",
            flush=True,
        )
        record(
            "graphs",
            batch=batch,
            context=context,
            splits=cfg.num_splits,
            eager_us=t_eager,
            launch_us=t_launch,
            graph_us=t_graph,
            sdpa_us=t_sdpa,
            sdpa_graph_us=t_sdpa_graph,
        )
        del case, k, v
        release()


def capture(step: Callable[[], Any]) -> Any:
    """One CUDA graph of ``step`` (warmed up on a side stream first, as torch asks); with
    --warm, ``step`` itself stands for its replay."""
    if WARM:
        return argparse.Namespace(replay=step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def matmul_tflops(n: int) -> float:
    """Dense ``DTYPE`` matmul TFLOP/s of two n x n matrices, timed in this run: the peak that
    extend is measured against."""
    a, b = randn(n, n), randn(n, n)
    t = timer(partial(torch.matmul, a, b))
    return 2 * n**3 / (t * 1e-6) / 1e12


@dataclass
class ExtendCase:
    q: torch.Tensor  # [B * new, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, blocks_per_seq] int32, shuffled
    seq_lens: torch.Tensor  # [B] int32 = cached + new
    query_start_loc: torch.Tensor  # [B + 1] int32
    batch: int
    cached: int
    new: int

    @property
    def flops(self) -> int:
        """Attention FLOPs: QK and AV over every causal (query, key) pair."""
        pairs = self.batch * (self.new * self.cached + self.new * (self.new + 1) // 2)
        return 4 * HEAD_DIM * NUM_Q_HEADS * pairs


def make_extend(batch: int, cached: int, new: int) -> ExtendCase:
    blocks = -(-(cached + new) // BLOCK_SIZE)
    num_blocks = batch * blocks
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return ExtendCase(
        q=randn(batch * new, NUM_Q_HEADS, HEAD_DIM),
        k_cache=randn(*shape),
        v_cache=randn(*shape),
        tables=torch.randperm(num_blocks, device=DEV).view(batch, blocks).int(),
        seq_lens=torch.full((batch,), cached + new, device=DEV, dtype=torch.int32),
        query_start_loc=torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * new,
        batch=batch,
        cached=cached,
        new=new,
    )


def extend(case: ExtendCase, config: Any = None) -> torch.Tensor:
    from prefixcache.kernels import paged_attention

    return paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.tables,
        case.seq_lens,
        case.query_start_loc,
        max_seq_len=case.cached + case.new,
        config=config,
        validate=False,
    )


def extend_sdpa(case: ExtendCase) -> Callable[[], torch.Tensor]:
    """SDPA over contiguous K/V with the same bottom-right aligned causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    ctx = case.cached + case.new
    blocks = case.tables.shape[1]

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        tokens = cache[case.tables.long()].view(case.batch, blocks * BLOCK_SIZE, NUM_KV_HEADS, -1)
        return tokens[:, :ctx].transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]

    k, v = contiguous(case.k_cache), contiguous(case.v_cache)
    q = case.q.view(case.batch, case.new, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = causal_lower_right(case.new, ctx)

    def run() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(-1, NUM_Q_HEADS, HEAD_DIM)

    return run


def bench_extend(cases: list[tuple[int, int, int]], sweep: bool) -> None:
    """Extend attention TFLOP/s against the same run's dense matmul; SDPA beside it."""
    from prefixcache.kernels import AttentionConfig
    from prefixcache.kernels.attention_launch import device_capability

    peak = matmul_tflops(8192 if DEV == "cuda" else 128)
    print(f"\n== extend (prefill over cached K/V), {DTYPE}: dense matmul {peak:,.0f} TFLOP/s")
    print(
        f"{'batch':>5} {'cached':>6} {'new':>5} {'us':>9} {'TFLOP/s':>8} {'%matmul':>7} "
        f"{'sdpa us':>8} {'vs sdpa':>7} {'maxdiff':>8}  config"
    )
    long_case = None
    for batch, cached, new in cases:
        case = make_extend(batch, cached, new)
        cfg = model_config(
            batch,
            batch * new,
            cached + new,
            num_sms(),
            capability=device_capability(torch.device(DEV)),
        )
        t = timer(partial(extend, case))
        tflops = case.flops / (t * 1e-6) / 1e12
        t_sdpa, diff = math.nan, math.nan
        try:
            run_sdpa = extend_sdpa(case)
            t_sdpa = timer(run_sdpa)
            diff = (extend(case).float() - run_sdpa().float()).abs().max().item()
        except (RuntimeError, ImportError, TypeError) as exc:  # a torch without this SDPA path
            print(f"      (SDPA not run: {type(exc).__name__}: {str(exc)[:80]})")
        share = 100 * tflops / peak
        print(
            f"{batch:>5} {cached:>6} {new:>5} {t:>9.1f} {tflops:>8.1f} {share:>6.1f}% "
            f"{t_sdpa:>8.1f} {t / t_sdpa:>6.2f}x {diff:>8.1e}  block_m {cfg.block_m}, "
            f"tile_n {cfg.tile_n}, {cfg.num_warps} warps, {cfg.num_stages} stages",
            flush=True,
        )
        record(
            "extend",
            batch=batch,
            cached=cached,
            new=new,
            us=t,
            tflops=tflops,
            matmul_tflops=peak,
            sdpa_us=t_sdpa,
            maxdiff=diff,
            config=[cfg.block_m, cfg.tile_n, cfg.num_warps, cfg.num_stages],
        )
        if long_case is None or case.flops > long_case.flops:
            long_case = case
        else:
            del case
        release()
    if not sweep or long_case is None:
        return
    c = long_case
    group = NUM_Q_HEADS // NUM_KV_HEADS
    print(f"\nextend configs on {c.batch} x ({c.cached} + {c.new}):")
    print(
        f"{'block_m':>7} {'tile_n':>6} {'warps':>5} {'stages':>6} {'masks':>6} {'us':>9} "
        f"{'TFLOP/s':>8} {'maxdiff':>8}"
    )
    chosen = extend(c).float()
    configs = [
        AttentionConfig(block_m // group, block_m, tile_n, 1, warps, stages)
        for block_m in (64, 128)
        for tile_n in (32, 64, 128)
        for warps in (4, 8)
        for stages in (2, 3)
    ]
    configs += [AttentionConfig(128 // group, 128, n, 1, 8, 4) for n in (64, 128)]
    configs += [AttentionConfig(128 // group, 128, 64, 1, 8, 2, unmasked_tiles=False)]
    for cfg in configs:
        masks = "every" if not cfg.unmasked_tiles else "edge"
        row = f"{cfg.block_m:>7} {cfg.tile_n:>6} {cfg.num_warps:>5} {cfg.num_stages:>6} {masks:>6}"
        try:
            t = timer(partial(extend, c, cfg), rep=50)
            diff = (extend(c, cfg).float() - chosen).abs().max().item()
        except Exception as exc:  # out of shared memory or registers on this GPU
            print(f"{row}  failed: {exc!s:.60}")
            continue
        tflops = c.flops / (t * 1e-6) / 1e12
        print(f"{row} {t:>9.1f} {tflops:>8.1f} {diff:>8.1e}", flush=True)
        record(
            "extend-configs",
            batch=c.batch,
            cached=c.cached,
            new=c.new,
            config=[cfg.block_m, cfg.tile_n, cfg.num_warps, cfg.num_stages],
            unmasked_tiles=cfg.unmasked_tiles,
            us=t,
            tflops=tflops,
            maxdiff=diff,
        )
    del long_case, c, chosen
    release()


def bench_fp8(grid: list[tuple[int, int]]) -> None:
    """Large-batch decode over e4m3 K/V (per-tensor scales) against the same K/V in DTYPE."""
    from prefixcache.kernels import paged_attention
    from prefixcache.kernels.reference import quantize_fp8

    print(f"\n== fp8 K/V decode (e4m3, per-tensor scales) against {DTYPE} K/V")
    print(
        f"{'batch':>5} {'ctx':>6} {'16-bit us':>9} {'fp8 us':>8} {'speed-up':>8} {'fp8 TB/s':>8} "
        f"{'%copy':>5} {'16-bit %copy':>12} {'err 16-bit':>10} {'err fp8':>8}"
    )
    for batch, context in grid:
        case = make_case(batch, context)
        k_scale = case.k_cache.float().abs().amax().item() / 448.0
        v_scale = case.v_cache.float().abs().amax().item() / 448.0
        k8, v8 = quantize_fp8(case.k_cache, k_scale), quantize_fp8(case.v_cache, v_scale)
        run16 = partial(paged, case, case.shuffled)
        run8 = partial(
            paged_attention,
            case.q,
            k8,
            v8,
            case.shuffled,
            case.seq_lens,
            case.query_start_loc,
            max_seq_len=context,
            k_scale=k_scale,
            v_scale=v_scale,
            validate=False,
        )
        t16, t8 = timer(run16), timer(run8)
        k, v = contiguous_kv(case, case.k_cache), contiguous_kv(case, case.v_cache)
        truth = sdpa(case.q.float(), k.float(), v.float())  # fp32, unquantized K/V
        err16 = (run16().float() - truth).abs().max().item()
        err8 = (run8().float() - truth).abs().max().item()
        fp8_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
        tbps = fp8_bytes / (t8 * 1e-6) / 1e12
        tbps16 = 2 * fp8_bytes / (t16 * 1e-6) / 1e12
        print(
            f"{batch:>5} {context:>6} {t16:>9.1f} {t8:>8.1f} {t16 / t8:>7.2f}x {tbps:>8.2f} "
            f"{100 * tbps / COPY_TBPS:>5.1f} {100 * tbps16 / COPY_TBPS:>12.1f} "
            f"{err16:>10.1e} {err8:>8.1e}",
            flush=True,
        )
        record(
            "fp8",
            batch=batch,
            context=context,
            bf16_us=t16,
            fp8_us=t8,
            fp8_tbps=tbps,
            bf16_tbps=tbps16,
            err16=err16,
            err8=err8,
        )
        del case, k8, v8, k, v, truth
        release()
    print("err: max |output - fp32 attention over the unquantized K/V|; q ~ N(0, 1), K/V ~ N(0, 1)")


def bench_store(sizes: list[int]) -> None:
    """store_kv launch cost and bandwidth: checked, unchecked (validate=False), CUDA graph."""
    from prefixcache.kernels import store_kv

    print(f"\n== store_kv ({DTYPE}, [tokens, {NUM_KV_HEADS}, {HEAD_DIM}] into shuffled slots)")
    print(
        f"{'tokens':>7} {'checked us':>10} {'unchecked us':>12} {'graph us':>9} {'GB/s':>7} "
        f"{'%copy':>5}"
    )
    for n in sizes:
        num_blocks = 2 * -(-n // BLOCK_SIZE)
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.zeros(shape, device=DEV, dtype=DTYPE)
        v_cache = torch.zeros(shape, device=DEV, dtype=DTYPE)
        k, v = randn(n, NUM_KV_HEADS, HEAD_DIM), randn(n, NUM_KV_HEADS, HEAD_DIM)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:n].int()
        checked = partial(store_kv, k, v, k_cache, v_cache, slots)
        unchecked = partial(store_kv, k, v, k_cache, v_cache, slots, validate=False)
        t_checked, t_fast = timer(checked), timer(unchecked)
        t_graph = timer(capture(unchecked).replay) if DEV == "cuda" else math.nan
        moved = 2 * 2 * k.numel() * k.element_size()  # K and V, read and written
        best = min(t_fast, t_graph) if DEV == "cuda" else t_fast
        gbps = moved / (best * 1e-6) / 1e9
        print(
            f"{n:>7} {t_checked:>10.1f} {t_fast:>12.1f} {t_graph:>9.1f} {gbps:>7.1f} "
            f"{100 * gbps / 1e3 / COPY_TBPS:>5.1f}",
            flush=True,
        )
        record(
            "store",
            tokens=n,
            checked_us=t_checked,
            unchecked_us=t_fast,
            graph_us=t_graph,
            gbps=gbps,
        )
        del k_cache, v_cache, k, v
        release()


SPLIT_GRID = [(b, c) for b in (1, 16, 64) for c in (1024, 8192, 32768) if b * c <= MAX_TOKENS]
SPLIT_GRID += [(1, 131072), (4, 32768)]
CONFIG_GRID = [(1, 32768), (16, 4096), (64, 4096), (256, 2048)]
FP8_CONFIG_GRID = [(64, 4096), (256, 2048)]
DECODE_CONFIGS = [(n, 4, s) for n in (32, 64, 128) for s in (2, 3)] + [(64, 4, 4), (128, 8, 2)]


def replay_us(step: Callable[[], Any], rep: int = 30) -> float:
    """Kernel time of ``step``: CUDA graph replays on the GPU, one eager call in a smoke run."""
    if DEV == "cuda":
        return timer(capture(step).replay, rep=rep)
    return timer(step)


def decode_step(case: DecodeCase, cfg: Any, k_scale: float | None = None, kv: Any = None) -> Any:
    """One graph-capturable decode call of ``case`` with ``cfg`` (fp8 when ``k_scale`` is set)."""
    from prefixcache.kernels import paged_attention, workspace_size

    out = torch.empty_like(case.q)
    batch = case.q.shape[0]
    ws = torch.empty(workspace_size(batch, NUM_Q_HEADS, HEAD_DIM), device=DEV)
    k_cache, v_cache = kv if kv is not None else (case.k_cache, case.v_cache)
    scale = 1.0 if k_scale is None else k_scale
    return partial(
        paged_attention,
        case.q,
        k_cache,
        v_cache,
        case.shuffled,
        case.seq_lens,
        case.query_start_loc,
        out=out,
        workspace=ws,
        max_seq_len=case.context,
        config=cfg,
        validate=False,
        k_scale=scale,
        v_scale=scale,
    )


def bench_splits(grid: list[tuple[int, int]], splits: tuple[int, ...]) -> None:
    """Small-batch decode kernel time (graph replay) for each KV split count."""

    sms = num_sms()
    print(f"\n== KV splits, decode kernel time from graph replays (us), {sms} SMs")
    print(f"{'batch':>5} {'ctx':>6} {'chosen':>6} " + " ".join(f"{f's={n}':>8}" for n in splits))
    for batch, context in grid:
        case = make_case(batch, context)
        base = model_config(
            batch,
            batch,
            context,
            sms,
        )
        times = []
        for n in splits:
            cfg = dataclasses.replace(base, num_splits=n)
            times.append(replay_us(decode_step(case, cfg)))
        print(
            f"{batch:>5} {context:>6} {base.num_splits:>6} "
            + " ".join(f"{t:>8.1f}" for t in times),
            flush=True,
        )
        record(
            "splits",
            batch=batch,
            context=context,
            chosen=base.num_splits,
            tile_n=base.tile_n,
            us=dict(zip(map(str, splits), times, strict=True)),
        )
        del case
        release()


def bench_decode_configs(grid: list[tuple[int, int]], fp8: bool = False) -> None:
    """Decode kernel time (graph replay) for tile_n x warps x stages, splits by the heuristic."""
    from prefixcache.kernels import AttentionConfig
    from prefixcache.kernels.config import DECODE_MIN_TILES_PER_SPLIT, choose_split
    from prefixcache.kernels.reference import quantize_fp8

    sms = num_sms()
    group = NUM_Q_HEADS // NUM_KV_HEADS
    kind = "fp8 e4m3" if fp8 else str(DTYPE)
    print(f"\n== decode configs ({kind} K/V), kernel time from graph replays (us) and TB/s")
    labels = [f"n{n}w{w}s{st}" for n, w, st in DECODE_CONFIGS] + ["n64w4s2 masked"]
    print(f"{'batch':>5} {'ctx':>6} " + " ".join(f"{label:>14}" for label in labels))
    for batch, context in grid:
        case = make_case(batch, context)
        kv, scale = None, None
        if fp8:
            scale = case.k_cache.float().abs().amax().item() / 448.0
            kv = (quantize_fp8(case.k_cache, scale), quantize_fp8(case.v_cache, scale))
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
        cells, rows = [], {}
        configs = [(n, w, st, True) for n, w, st in DECODE_CONFIGS] + [(64, 4, 2, False)]
        for tile_n, warps, stages, unmasked in configs:
            splits = choose_split(
                batch * NUM_KV_HEADS, context, tile_n, sms, DECODE_MIN_TILES_PER_SPLIT
            )
            cfg = AttentionConfig(
                1, max(16, group), tile_n, splits, warps, stages, unmasked_tiles=unmasked
            )
            try:
                t = replay_us(decode_step(case, cfg, scale, kv))
            except Exception as exc:  # out of resources on this GPU
                print(f"      n{tile_n}w{warps}s{stages} failed: {exc!s:.60}")
                t = math.nan
            tbps = kv_bytes / (t * 1e-6) / 1e12
            cells.append(f"{t:>7.1f} {tbps:>5.2f}T")
            rows[f"n{tile_n}w{warps}s{stages}{'' if unmasked else 'm'}"] = [splits, t, tbps]
        print(f"{batch:>5} {context:>6} " + " ".join(f"{c:>14}" for c in cells), flush=True)
        record("fp8-configs" if fp8 else "decode-configs", batch=batch, context=context, **rows)
        del case, kv
        release()
    print("nNwWsS: tile_n N, W warps, S stages (splits from the heuristic); masked: every tile")


STORE_CONFIGS = [(t, w) for t in (8, 16, 32, 64, 128) for w in (2, 4, 8)]


def bench_store_configs(sizes: list[int]) -> None:
    """store_kv kernel time (graph replay) for tokens per program x warps."""
    from prefixcache.kernels.config import StoreConfig
    from prefixcache.kernels.store import launch_store

    print(f"\n== store_kv configs ({DTYPE}), graph replay: us and % of the copy bandwidth")
    print(f"{'tokens':>7} " + " ".join(f"{f't{t}w{w}':>12}" for t, w in STORE_CONFIGS))
    for n in sizes:
        num_blocks = 2 * -(-n // BLOCK_SIZE)
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.zeros(shape, device=DEV, dtype=DTYPE)
        v_cache = torch.zeros(shape, device=DEV, dtype=DTYPE)
        k, v = randn(n, NUM_KV_HEADS, HEAD_DIM), randn(n, NUM_KV_HEADS, HEAD_DIM)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:n].int()
        moved = 2 * 2 * k.numel() * k.element_size()
        cells, rows = [], {}
        for block_t, warps in STORE_CONFIGS:
            cfg = StoreConfig(block_t, warps)
            step = partial(
                launch_store, k, v, k_cache, v_cache, slots, 1.0, 1.0, fp8=False, cfg=cfg
            )
            t = replay_us(step)
            share = 100 * moved / (t * 1e-6) / 1e12 / COPY_TBPS
            cells.append(f"{t:>6.1f} {share:>4.0f}%")
            rows[f"t{block_t}w{warps}"] = [t, moved / (t * 1e-6) / 1e9]
        print(f"{n:>7} " + " ".join(f"{c:>12}" for c in cells), flush=True)
        record("store-configs", tokens=n, **rows)
        del k_cache, v_cache, k, v
        release()


def use_smoke_shapes() -> None:
    """Tiny shapes on the CPU (fp32 through the interpreter, which mis-multiplies bf16)."""
    global DEV, DTYPE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    DEV, DTYPE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = "cpu", torch.float32, 4, 2, 64


def main(argv: list[str] | None = None) -> int:
    global JSON_PATH, COPY_TBPS, WARM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few shapes of each part")
    parser.add_argument(
        "--smoke", action="store_true", help="every part with tiny shapes on the CPU"
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run: {', '.join(PARTS)}"
    )
    parser.add_argument("--json", type=Path, help="append one JSON line per measured row")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="run every launch of the parts once, untimed, to fill Triton's compile cache (e.g. "
        "a few processes with different --parts in parallel before the timed run)",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    JSON_PATH = args.json
    WARM = args.warm
    if args.smoke:
        use_smoke_shapes()
        COPY_TBPS = copy_tbps(1 << 20)
        bench([(2, 64)])
        bench_shared_prefix(batch=4, shared=64, own=32)
        bench_graphs([(1, 64)])
        bench_extend([(2, 32, 16), (1, 0, 32)], sweep=True)
        bench_fp8([(2, 64)])
        bench_store([64])
        bench_splits([(1, 256)], (1, 2))
        bench_decode_configs([(2, 64)])
        bench_decode_configs([(2, 64)], fp8=True)
        bench_store_configs([64])
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs an NVIDIA GPU (nothing was run)", file=sys.stderr)
        return 1
    status = 0 if args.skip_tests else run_tests()
    if args.skip_bench:
        return status
    COPY_TBPS = copy_tbps()
    print(f"\n== device-to-device copy of 2 GiB: {COPY_TBPS:.2f} TB/s (read + written)")
    record("copy", tbps=COPY_TBPS)
    q = args.quick
    runs: dict[str, Callable[[], None]] = {
        "decode": partial(bench, QUICK_GRID if q else GRID),
        "shared": bench_shared_prefix,
        "graphs": partial(bench_graphs, SMALL_BATCH_GRID[:2] if q else SMALL_BATCH_GRID),
        "extend": partial(bench_extend, EXTEND_CASES[1:2] if q else EXTEND_CASES, sweep=not q),
        "fp8": partial(bench_fp8, FP8_GRID[:1] if q else FP8_GRID),
        "store": partial(bench_store, STORE_TOKENS),
        "splits": partial(bench_splits, SPLIT_GRID[:2] if q else SPLIT_GRID, (1, 2, 4, 8, 16, 32)),
        "decode-configs": partial(bench_decode_configs, CONFIG_GRID[:1] if q else CONFIG_GRID),
        "fp8-configs": partial(
            bench_decode_configs, FP8_CONFIG_GRID[:1] if q else FP8_CONFIG_GRID, fp8=True
        ),
        "store-configs": partial(bench_store_configs, STORE_TOKENS[1:]),
    }
    for part in parts:
        t0 = time.perf_counter()
        runs[part]()
        print(f"({part}: {time.perf_counter() - t0:.0f} s)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
