"""Replays with a host tier and a shared pool: exact miss breakdown, pool, serving, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.block_events import BlockRemoved, BlockStored
from prefixcache.replay import ReplayConfig
from prefixcache.replay.runner import replay_path
from prefixcache.replay.tiers.shared_pool import PoolFeed, PoolTier

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
GIB = 2**30


def _config(**changes: object) -> ReplayConfig:
    base = ReplayConfig(capacity_blocks=200, model="llama-3.1-8b", block_size=512)
    return base.with_(**changes)


def _check_exact(report: dict) -> None:
    tiers = report["tiers"]
    hit = tiers["gpu_hit_tokens"] + tiers["host_hit_tokens"] + tiers["pool_hit_tokens"]
    assert hit == report["hit_tokens"]
    assert hit + tiers["computed_tokens"] == report["prompt_tokens"]
    assert sum(report["misses"].values()) == tiers["computed_tokens"]


@pytest.mark.parametrize(
    "tiers",
    [
        {"host_memory": 8 * GIB},
        {"pool_memory": 64 * GIB},
        {"host_memory": 8 * GIB, "pool_memory": 64 * GIB},
    ],
)
def test_tier_hits_are_not_misses_and_the_breakdown_sums(tiers: dict) -> None:
    plain = replay_path(SAMPLE, _config()).to_report_dict()
    report = replay_path(SAMPLE, _config(**tiers)).to_report_dict()
    _check_exact(report)
    lower = report["tiers"]["host_hit_tokens"] + report["tiers"]["pool_hit_tokens"]
    assert lower > 0
    # the GPU tier behaves as without tiers; what the lower tiers served were capacity misses
    assert report["tiers"]["gpu_hit_tokens"] == plain["hit_tokens"]
    assert report["misses"]["cold"] == plain["misses"]["cold"]
    assert report["misses"]["capacity"] == plain["misses"]["capacity"] - lower


def test_tiers_off_reports_no_tiers() -> None:
    report = replay_path(SAMPLE, _config()).to_report_dict()
    assert "tiers" not in report and "tiers" not in report["config"]


def test_pool_is_lru_and_chains() -> None:
    pool = PoolTier(2)
    for d in (b"a", b"b", b"c"):
        pool.put(d)
    assert b"a" not in pool and pool.evicted_blocks == 1
    assert pool.match([b"b", b"c", b"x"]) == 2
    assert pool.match([b"x", b"b"]) == 0  # only a continuation of the chain is found
    pool.touch([b"b"])
    pool.put(b"d")
    assert b"c" not in pool and b"b" in pool


def test_pool_feed_pools_only_blocks_that_leave_the_replica() -> None:
    pool = PoolTier(10)
    feed = PoolFeed(pool)
    ns = Namespace("default")
    feed(BlockStored([b"a", b"b"], None, [], 1, ns))
    feed(BlockRemoved([b"b"], ns))  # offloaded: on host next
    feed(BlockStored([b"b"], b"a", [], 1, ns, "CPU"))
    feed.flush()
    assert len(pool) == 0
    feed(BlockRemoved([b"b"], ns, "CPU"))  # loaded back to the GPU
    feed(BlockStored([b"b"], b"a", [], 1, ns))
    feed(BlockRemoved([b"a"], ns))  # evicted with no host room: leaves the replica
    feed.flush()
    assert b"b" not in pool and b"a" in pool


def test_pool_is_shared_by_replicas() -> None:
    config = _config(mode="serving", capacity_blocks=100, replicas=2, pool_memory=64 * GIB)
    report = replay_path(SAMPLE, config).to_report_dict()
    _check_exact(report)
    assert report["tiers"]["pool_hit_tokens"] > 0


def test_serving_ttft_pays_for_transfers() -> None:
    # 6 GB/s: still faster than recomputing a block of llama-3.1-8b on an H100, much slower
    # than the default link
    slow = replay_path(SAMPLE, _config(mode="serving", pool_memory=64 * GIB, pool_bw=6e9))
    fast = replay_path(SAMPLE, _config(mode="serving", pool_memory=64 * GIB))
    s, f = slow.to_report_dict()["tiers"], fast.to_report_dict()["tiers"]
    assert s["pool_hit_tokens"] > 0 and f["pool_hit_tokens"] > 0
    per_block = [t["transfer_seconds"] / t["pool"]["loaded_blocks"] for t in (s, f)]
    assert per_block[0] == pytest.approx(per_block[1] * 25 / 6)
    assert slow.serving is not None and fast.serving is not None
    assert slow.serving.simulated_seconds > fast.serving.simulated_seconds
    assert f["net_prefill_seconds_saved"] == f["prefill_seconds_saved"] - f["transfer_seconds"]


def test_loads_slower_than_recompute_are_recomputed() -> None:
    report = replay_path(SAMPLE, _config(pool_memory=64 * GIB, pool_bw=1e6)).to_report_dict()
    assert report["tiers"]["pool_hit_tokens"] == 0
    assert report["tiers"]["pool"]["found_blocks"] > 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", "replay", str(SAMPLE), *args],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--blocks", "100", "--pool-memory", "8GiB"], "need --model"),
        (["--blocks", "100", "--model", "llama-3.1-8b", "--host-memory", "1MiB"], "hold no block"),
        (["--blocks", "100", "--host-bw", "10GB"], "needs --host-memory"),
        (["--blocks", "100", "--pool-bw", "1GB", "--host-memory", "1GiB"], "needs --pool-memory"),
    ],
)
def test_cli_errors(args: list[str], message: str, tmp_path: Path) -> None:
    done = _cli(*args, "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_cli_bad_size_exits_2(tmp_path: Path) -> None:
    done = _cli("--blocks", "100", "--host-memory", "lots", "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    done = _cli("--blocks", "100,200", "--jobs", "0", "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "--jobs: expected a positive integer: '0'" in done.stderr


def test_cli_sweep_per_tier(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = _cli(
        "--blocks", "200", "--model", "llama-3.1-8b", "--host-memory", "0,8GiB",
        "--pool-memory", "0,64GiB", "--jobs", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sweep = json.loads((out / "report.json").read_text())["sweep"]
    assert [(r["host_blocks"], r["pool_blocks"]) for r in sweep] == [
        (0, 0), (0, 1024), (128, 0), (128, 1024),
    ]  # fmt: skip
    assert sweep[0]["host_token_hit_rate"] == sweep[0]["pool_token_hit_rate"] == 0
    assert sweep[3]["token_hit_rate"] > sweep[0]["token_hit_rate"]
    # the summary tells the points apart
    rows = done.stdout.split("  sweep ")[1].splitlines()[1:5]
    assert [row.split()[3:5] for row in rows] == [["0", "0"], ["0", "1,024"], ["128", "0"],
                                                  ["128", "1,024"]]  # fmt: skip
    # a run compared with itself: every point meets its own twin, no difference anywhere
    from prefixcache.cli import main

    assert main(["compare", str(out), str(out), "--no-definitions"]) == 0


def test_points_that_differ_only_in_a_tier_are_matched_and_curved_apart(tmp_path: Path) -> None:
    from prefixcache.report import load_run
    from prefixcache.report.compare import compare_document
    from prefixcache.report.sweep_curves import capacity_knees

    out = tmp_path / "run"
    done = _cli(
        "--blocks", "50,100,200,400", "--model", "llama-3.1-8b", "--host-memory", "0,8GiB",
        "--jobs", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = load_run(out)
    knees = capacity_knees(run.report["sweep"])
    assert all(label.startswith("host blocks") for label in knees)  # one curve per host size
    doc = compare_document(run, run)
    table = next(t for s in doc.sections for t in s.tables if "Token hit rate Δ" in t.columns)
    delta = table.columns.index("Token hit rate Δ")
    assert len(table.rows) == 8 and {row[delta] for row in table.rows} == {"+0.00 pp"}


def test_recompute_is_priced_at_the_serving_gpus_efficiency() -> None:
    # the load-or-recompute rule uses the MFU the step times use: a fitted GPU's, else 0.5
    from prefixcache.replay.model_specs import get_gpu, get_model
    from prefixcache.replay.tiers.sizes import resolve_tiers

    model = get_model("llama-3.1-8b")
    for name, mfu in (("h200", get_gpu("h200").compute_efficiency), ("l40s", 0.5)):
        gpu = get_gpu(name)
        tiers = resolve_tiers(2**30, None, 55e9, 25e9, model, gpu, name, 16, 1)
        assert tiers is not None and tiers.recompute_mfu == mfu
        flops = gpu.peak_flops * mfu
        assert tiers.recompute_seconds_per_token == pytest.approx(
            2 * model.layer_flops_params / flops
        )


def test_the_pooled_line_pools_the_host_tiers_too() -> None:
    """The fleet's upper bound (one replica with N x everything) has N x the host memory too:
    it never hits less than the fleet it bounds."""
    cfg = _config(mode="serving", replicas=4, host_memory=4 * GIB, capacity_blocks=32)
    report = replay_path(SAMPLE, cfg).to_report_dict()
    pooled = report["fleet"]["pooled"]["token_hit_rate"]
    assert report["tiers"]["host_hit_tokens"] > 0
    assert pooled >= report["token_hit_rate"]


def test_a_single_tier_run_meets_its_twin_in_a_sweep(tmp_path: Path) -> None:
    # a run without a sweep had no host/pool keys: compare called it "host blocks None" and
    # matched none of the sweep's points, not even the identical one
    from prefixcache.report import load_run
    from prefixcache.report.compare import run_points, sweep_section

    common = ["--blocks", "200", "--model", "llama-3.1-8b", "--jobs", "1"]
    one, plain, sweep = tmp_path / "one", tmp_path / "plain", tmp_path / "sweep"
    assert _cli(*common, "--host-memory", "8GiB", "--out", str(one)).returncode == 0
    assert _cli(*common, "--out", str(plain)).returncode == 0
    assert _cli(*common, "--host-memory", "0,8GiB", "--out", str(sweep)).returncode == 0
    assert run_points(load_run(one))[0]["host_blocks"] == 128
    for single, host in ((one, 128), (plain, 0)):
        section = sweep_section(load_run(single), load_run(sweep))
        assert section.title == "Sweep points: 1 of A's 1 match B's 2", (host, section.title)
        (row,) = section.tables[0].rows
        assert str(host) in row and "None" not in row
