"""The block pool's bookkeeping grows with the blocks used, not the pool's size; an unbounded
cache (``--blocks inf``) never evicts."""

from __future__ import annotations

import io
import json
import random
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

from prefixcache import CacheManager
from prefixcache.blocks.pool import UNBOUNDED, BlockPool
from prefixcache.cli import main
from prefixcache.replay import ReplayConfig, replay_path
from prefixcache.report.checks import consistency_checks
from prefixcache.report.run_dir import load_run

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


def test_a_huge_pool_allocates_nothing_up_front() -> None:
    tracemalloc.start()
    try:
        mgr = CacheManager(10_000_000, 16)
        mgr.admit("a", np.arange(100, dtype=np.int32))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # a list per block would take 80 MB
    assert mgr.block_counts().free == 10_000_000 - 7


def test_blocks_come_out_in_the_order_of_a_full_free_stack() -> None:
    """The lazy pool hands out the same ids as a stack holding every id would."""
    n = 64
    pool, stack = BlockPool(n), list(range(n - 1, -1, -1))
    rng = random.Random(5)
    held: list[int] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not stack):
            k = rng.randint(1, len(held))
            back, held = held[:k], held[k:]
            rng.shuffle(back)
            pool.drop(back)
            stack.extend(back)
        else:
            k = rng.randint(1, len(stack))
            ids = pool.take(k)
            expected = stack[-k:][::-1]
            del stack[-k:]
            assert ids == expected
            held += ids
        assert pool.num_free == len(stack) and pool.num_private == len(held)
        assert sorted(pool.free_ids()) == sorted(stack)


def test_an_unbounded_cache_keeps_every_block() -> None:
    mgr = CacheManager(UNBOUNDED, 4)
    rng = np.random.default_rng(0)
    for i in range(300):
        mgr.admit(i, rng.integers(0, 1000, 37, dtype=np.int32))
        if i % 3:
            mgr.release(i)
    mgr.check_integrity()
    counts = mgr.block_counts()
    assert mgr.stats.evicted_blocks == 0
    assert counts.active + counts.cached + counts.free == UNBOUNDED
    # every full block stays (cached or active); only released partial last blocks came back
    assert counts.active + counts.cached == 300 * 9 + 100


def test_an_unbounded_replay_reaches_its_upper_bound(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["replay", str(SAMPLE), "--blocks", "inf", "--out", str(tmp_path / "r")])
    assert code == 0, err.getvalue()
    assert "cache unbounded," in out.getvalue() and "unbounded blocks" not in out.getvalue()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["evicted_blocks"] == 0 and report["misses"]["capacity"] == 0
    assert report["config"]["capacity_blocks"] == UNBOUNDED
    finite = replay_path(  # the CLI takes a Mooncake trace's own block size (512)
        SAMPLE, ReplayConfig(capacity_blocks=2_000_000, block_size=512)
    ).to_report_dict()
    assert report["hit_tokens"] == finite["hit_tokens"]
    assert report["token_hit_rate"] == report["upper_bound_token_hit_rate"]
    assert all(check.ok for check in consistency_checks(load_run(tmp_path / "r")))


def test_a_bad_block_count_is_one_error_line(tmp_path: Path) -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            main(["replay", str(SAMPLE), "--blocks", "infinite", "--out", str(tmp_path / "r")])
        except SystemExit as exc:
            assert exc.code == 2
    assert "expected block counts (or inf) separated by commas: 'infinite'" in err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_unbounded_replicas_pool_to_one_unbounded_cache(tmp_path: Path) -> None:
    chat = ROOT / "tests" / "golden" / "chat_small.yaml"
    argv = ["replay", str(chat), "--mode", "serving", "--blocks", "inf", "--replicas", "2"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*argv, "--out", str(tmp_path / "r")])
    assert code == 0, err.getvalue()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["fleet"]["pooled"]["capacity_blocks"] == UNBOUNDED
    assert "(one replica, unbounded, 2x compute)" in out.getvalue()
