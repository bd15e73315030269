"""Sweeps: curve grouping, the knee, and the sweep section in every format."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report_figures import markdown_rows, shown
from test_report_runs import write_run

from prefixcache.report import build_document, load_run, render_markdown
from prefixcache.report.sweep_curves import (
    capacity_knees,
    extra_keys,
    knee_index,
    series,
    use_log_x,
)


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
        }
        for p in ("lru", "lfu")
        for c, r in ((400, 0.5), (100, 0.2), (200, 0.4))
    ]
    curves = series(points, "capacity_blocks", ["policy"])
    assert list(curves) == ["policy lru", "policy lfu"]
    assert [p["capacity_blocks"] for p in curves["policy lfu"]] == [100, 200, 400]
    assert extra_keys(points) == ["replicas"]
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
    assert "Block size" in header and "Policy" in header and "Replay seconds" in header
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
