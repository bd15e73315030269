"""Sweeps: curve grouping, the knee, and the sweep section in every format."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from test_report_figures import markdown_rows, shown
from test_report_runs import write_run

from prefixcache.cli import main
from prefixcache.report import build_document, html_report, load_run, render_markdown
from prefixcache.report import formatting as fmt
from prefixcache.report.render.text_formats import render_terminal
from prefixcache.report.sweep_curves import (
    capacity_knees,
    extra_keys,
    knee_index,
    series,
    use_log_x,
)
from prefixcache.run_format import MISS_CAUSES

GOLDEN_CHAT = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"


def test_knee_of_a_saturating_curve() -> None:
    xs = [1, 2, 3, 4, 5, 6, 7, 8]
    ys = [0.1, 0.5, 0.8, 0.85, 0.87, 0.88, 0.89, 0.9]
    assert knee_index(xs, ys, log_x=False) == 2


def test_no_knee_without_curvature_or_points() -> None:
    assert knee_index([1, 2, 3], [0.1, 0.2, 0.3], log_x=False) is None  # straight line
    assert knee_index([1, 2, 3], [0.1, 0.15, 0.3], log_x=False) is None  # convex
    assert knee_index([1, 2], [0.1, 0.9], log_x=False) is None
    assert knee_index([1, 2, 3], [0.5, 0.5, 0.5], log_x=False) is None


def test_log_axis_moves_the_knee() -> None:
    xs = [32, 64, 128, 256, 512, 1024, 2048, 4096]
    ys = [0.02, 0.04, 0.08, 0.15, 0.28, 0.50, 0.62, 0.70]
    assert use_log_x(xs) and not use_log_x([100, 200, 400])
    assert xs[knee_index(xs, ys, log_x=True)] == 2048
    assert xs[knee_index(xs, ys, log_x=False)] == 1024


def test_series_group_by_variant_and_sort() -> None:
    points = [
        {
            "capacity_blocks": c,
            "token_hit_rate": r,
            "block_hit_rate": r,
            "evicted_blocks": 0,
            "policy": p,
            "replicas": 2,
            "gpu_token_hit_rate": r,
        }
        for p in ("lru", "lfu")
        for c, r in ((400, 0.5), (100, 0.2), (200, 0.4))
    ]
    curves = series(points, "capacity_blocks", ["policy"])
    assert list(curves) == ["policy lru", "policy lfu"]
    assert [p["capacity_blocks"] for p in curves["policy lfu"]] == [100, 200, 400]
    assert extra_keys(points) == ["gpu_token_hit_rate"]  # replicas tell points apart
    assert {k: p["capacity_blocks"] for k, p in capacity_knees(points).items()} == {
        "policy lru": 200,
        "policy lfu": 200,
    }


@pytest.fixture(scope="module")
def full_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("run"), n=80, sweep="full")


def test_sweep_table_has_every_point_and_variant(full_sweep: Path) -> None:
    run = load_run(full_sweep)
    md = render_markdown(build_document(run))
    header = next(line for line in md.splitlines() if line.startswith("| Capacity (blocks)"))
    assert "Block size (tokens)" in header and "Eviction policy" in header
    assert "Replay seconds" in header
    rows = markdown_rows(md)
    table_rows = [r for k, rs in rows.items() if k[0].isdigit() for r in rs]
    assert len(table_rows) == len(run.report["sweep"]) == 48
    point = next(
        p
        for p in run.report["sweep"]
        if (p["capacity_blocks"], p["block_size"], p["policy"]) == (256, 32, "lfu")
    )
    row = next(r for r in rows["256"] if r[:2] == ["32", "lfu"])
    assert shown(row[2], point["token_hit_rate"]) and shown(row[3], point["block_hit_rate"])
    assert sum("◀ knee" in r[-1] for r in table_rows) == 6


def test_sweep_plots_are_drawn(full_sweep: Path) -> None:
    from prefixcache.report import html_report

    page = html_report(full_sweep)
    for name in ("sweep capacity", "sweep block size", "sweep policy"):
        assert f'alt="{name}"' in page


@pytest.fixture(scope="module")
def replayed_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replayed") / "run"
    args = [str(GOLDEN_CHAT), "--blocks", "120,1000", "--policy", "lru,lfu", "--jobs", "1"]
    with contextlib.redirect_stdout(io.StringIO()) as summary:
        assert main(["replay", *args, "--out", str(out), "--no-progress"]) == 0
    (out / "summary.txt").write_text(summary.getvalue())
    return out


def test_sweep_points_split_their_misses_by_cause(replayed_sweep: Path) -> None:
    run = load_run(replayed_sweep)
    report, points = run.report, run.report["sweep"]
    assert len(points) == 4
    for p in points:
        assert set(p["misses"]) == set(MISS_CAUSES)
        missed = p["prompt_tokens"] * (1 - p["token_hit_rate"])
        assert sum(p["misses"].values()) == pytest.approx(missed, abs=0.5)
    # the primary point is the run itself
    assert points[0]["misses"] == report["misses"]
    small, large = (
        next(p for p in points if (p["capacity_blocks"], p["policy"]) == (c, "lru"))
        for c in (120, 1000)
    )
    assert small["misses"]["capacity"] > large["misses"]["capacity"]
    assert small["misses"]["cold"] == pytest.approx(large["misses"]["cold"], rel=0.01)


def test_sweep_misses_in_every_format(replayed_sweep: Path) -> None:
    run = load_run(replayed_sweep)
    point = next(
        p for p in run.report["sweep"] if p["policy"] == "lfu" and p["capacity_blocks"] == 120
    )
    share = point["misses"]["capacity"] / point["prompt_tokens"]
    doc = build_document(run)
    md = render_markdown(doc)
    header = next(line for line in md.splitlines() if line.startswith("| Capacity (blocks)"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "Cold miss" in columns and "Capacity miss" in columns
    row = next(r for r in markdown_rows(md)["120"] if "lfu" in r)
    assert shown(row[columns.index("Capacity miss") - 1], share)
    terminal = render_terminal(doc, definitions=False)
    assert "Capacity miss" in terminal
    html = html_report(run)
    assert "<th>Capacity miss</th>" in html and "<th>Cold miss</th>" in html
    summary = (replayed_sweep / "summary.txt").read_text()
    assert "capacity miss" in summary and fmt.pct(share) in summary


def test_sweeps_without_misses_still_render(full_sweep: Path) -> None:
    md = render_markdown(build_document(load_run(full_sweep)))
    header = next(line for line in md.splitlines() if line.startswith("| Capacity (blocks)"))
    assert "miss" not in header
