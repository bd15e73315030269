"""Plot geometry: units and tick labels, legends clear of labels, axes scaled to the data."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backend_bases import RendererBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from test_report_runs import write_run

from prefixcache.report import load_run
from prefixcache.report.render import plots, sweep_plots
from prefixcache.report.run_dir import Run


def rendered(fig: Figure) -> RendererBase:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def visible_labels(labels: list[Text]) -> list[Text]:
    return [t for t in labels if t.get_visible() and t.get_text()]


def overlapping(boxes: list[Bbox]) -> list[tuple[int, int]]:
    return [(i, j) for (i, a), (j, b) in combinations(enumerate(boxes), 2) if a.overlaps(b)]


@pytest.fixture
def serving_run(tmp_path: Path) -> Run:
    return load_run(write_run(tmp_path / "run", n=60, sweep="none"))


@pytest.fixture
def sweep_run(tmp_path: Path) -> Run:
    return load_run(write_run(tmp_path / "run", n=60, sweep="capacity"))


def test_ttft_axis_in_seconds_without_offset_for_long_latencies(serving_run: Run) -> None:
    # an overloaded run: time to first token in the thousands of seconds
    for column in ("ttft_s", "ttft_nocache_s"):
        serving_run.requests[column] = 4000.0 + serving_run.requests[column] * 100
    fig = plots.ttft(serving_run)
    rendered(fig)
    (ax,) = fig.axes
    assert ax.get_xlabel().endswith("(s)")
    assert ax.xaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in visible_labels(ax.get_xticklabels())]
    assert labels and all("e" not in t and "×" not in t for t in labels), labels
    values = [float(t.replace(",", "").replace("−", "-")) for t in labels]
    lo, hi = ax.get_xlim()
    assert 3000 < lo < hi < 10_000 and sum(lo <= v <= hi for v in values) >= 3


def test_ttft_axis_in_milliseconds_below_a_second(serving_run: Run) -> None:
    assert float(np.nanmax(serving_run.requests["ttft_nocache_s"])) < 1.0
    fig = plots.ttft(serving_run)
    rendered(fig)
    (ax,) = fig.axes
    assert ax.get_xlabel().endswith("(ms)")
    assert ax.xaxis.get_offset_text().get_text() == ""


def test_capacity_tick_labels_do_not_overlap(sweep_run: Run) -> None:
    capacities = sorted({int(64 * 1.35**i) for i in range(40)})
    sweep_run.report["sweep"] = [
        {
            "capacity_blocks": c,
            "token_hit_rate": 0.8 * (1 - np.exp(-c / 5000)),
            "block_hit_rate": 0.8 * (1 - np.exp(-c / 5000)),
            "evicted_blocks": 0,
        }
        for c in capacities
    ]
    fig = sweep_plots.capacity(sweep_run)
    renderer = rendered(fig)
    ax = fig.axes[0]
    labels = visible_labels(ax.get_xticklabels())
    assert 3 <= len(labels) <= sweep_plots.MAX_CAPACITY_TICKS
    assert labels[0].get_text() == "64"
    assert labels[-1].get_text() == plots.compact_count(capacities[-1])
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert overlapping(boxes) == [], [t.get_text() for t in labels]


def test_compact_capacity_labels() -> None:
    assert [plots.compact_count(v) for v in (512, 4096, 16384, 1_500_000)] == [
        "512",
        "4,096",
        "16.4k",
        "1.5M",
    ]


def test_legend_leaves_the_knee_label_visible(sweep_run: Run) -> None:
    fig = sweep_plots.capacity(sweep_run)
    renderer = rendered(fig)
    ax = fig.axes[0]
    knee = [t for t in ax.texts if t.get_gid() == "knee_label"]
    assert len(knee) == 1 and knee[0].get_text().startswith("knee: ")
    legends = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
    assert len(legends) == 1
    legend_box = legends[0].get_window_extent(renderer)
    assert not legend_box.overlaps(knee[0].get_window_extent(renderer))
    assert not legend_box.overlaps(ax.get_window_extent(renderer))  # nothing in the axes hidden


def _set_capacity(run: Run, capacity: int) -> int:
    tl = run.timeline
    used = tl["blocks_active"] + tl["blocks_cached"]
    run.report["config"]["capacity_blocks"] = capacity
    tl["blocks_free"] = capacity - used
    return int(used.max())


def test_timeline_scales_to_the_blocks_in_use(serving_run: Run) -> None:
    used = _set_capacity(serving_run, 1_000_000)
    fig = plots.timeline(serving_run)
    rendered(fig)
    blocks = fig.axes[0]
    bottom, top = blocks.get_ylim()
    assert bottom == 0 and used <= top <= 1.5 * used
    assert "capacity 1,000,000 blocks" in blocks.get_title(loc="right")
    assert blocks.yaxis.get_offset_text().get_text() == ""


def test_timeline_marks_a_capacity_within_reach(serving_run: Run) -> None:
    used = _set_capacity(serving_run, 0)
    capacity = used + 5
    _set_capacity(serving_run, capacity)
    fig = plots.timeline(serving_run)
    blocks = fig.axes[0]
    lines = [line for line in blocks.get_lines() if line.get_label() == "capacity"]
    assert len(lines) == 1 and lines[0].get_ydata()[0] == capacity
    assert capacity < blocks.get_ylim()[1] < 1.2 * capacity


def test_miss_axis_has_no_offset_and_hit_axis_stops_at_100_percent(serving_run: Run) -> None:
    serving_run.report["misses"] = {**serving_run.report["misses"], "cold": 2_540_544}
    fig = plots.misses(serving_run)
    rendered(fig)
    (ax,) = fig.axes
    assert ax.xaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in visible_labels(ax.get_xticklabels())]
    assert any(t.endswith("M") for t in labels), labels
    fig = plots.headline(serving_run)
    rendered(fig)
    (ax,) = fig.axes
    labels = [t.get_text() for t in visible_labels(ax.get_xticklabels())]
    assert labels[-1] == "100%", labels


def test_fleet_timeline_marks_the_fleet_capacity(serving_run: Run) -> None:
    """A fleet's timeline adds up its replicas' blocks, so its capacity is all of theirs."""
    _set_capacity(serving_run, 1_000_000)
    serving_run.report["config"]["replicas"] = 3
    fig = plots.timeline(serving_run)
    rendered(fig)
    assert "capacity 3,000,000 blocks" in fig.axes[0].get_title(loc="right")


def test_an_unbounded_sweep_point_is_drawn_apart_from_the_curve(sweep_run: Run) -> None:
    """``--blocks ...,inf``: the unbounded point is not placed at x = 9.2e18 (which squashes the
    curve into the left edge) but marked at the right edge and labelled."""
    from prefixcache.blocks.pool import UNBOUNDED

    points = sweep_run.report["sweep"]
    finite = sorted(p["capacity_blocks"] for p in points)
    points.append(dict(points[-1], capacity_blocks=UNBOUNDED, token_hit_rate=0.9))
    fig = sweep_plots.capacity(sweep_run)
    renderer = rendered(fig)
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert hi < finite[-1] * 4 and lo > 0, (lo, hi)
    for line in ax.get_lines():
        xs = np.asarray(line.get_xdata(), dtype=float)
        assert not (xs >= UNBOUNDED).any(), line.get_label()
    unbounded = [t for t in ax.texts if t.get_gid() == "unbounded_label"]
    assert len(unbounded) == 1 and unbounded[0].get_text() == "unbounded: 90.00%"
    assert ax.get_window_extent(renderer).contains(*unbounded[0].get_window_extent(renderer).p1)
    labels = [t.get_text() for t in visible_labels(ax.get_xticklabels())]
    assert labels and all("e+" not in t for t in labels), labels


def test_a_sweep_at_one_capacity_is_drawn_as_bars_per_variant(sweep_run: Run) -> None:
    """A routing-only sweep (one capacity, several routing policies) is a bar per policy, not
    points stacked on one vertical line of a capacity axis."""
    base = sweep_run.report["sweep"][0]
    rates = {"round_robin": 0.5, "prefix": 0.7, "prefix_cost": 0.8}
    sweep_run.report["sweep"] = [
        dict(base, replicas=2, routing=name, token_hit_rate=rate) for name, rate in rates.items()
    ]
    fig = sweep_plots.capacity(sweep_run)
    rendered(fig)
    ax = fig.axes[0]
    assert [round(b.get_height(), 3) for b in ax.patches] == list(rates.values())
    labels = [t.get_text() for t in visible_labels(ax.get_xticklabels())]
    assert labels == list(rates)
    assert "routing" in ax.get_xlabel()
    assert f"{base['capacity_blocks']:,}" in ax.get_title()


@pytest.mark.parametrize("capacity", ["near", "far"])
def test_the_block_chart_legend_covers_no_data(serving_run: Run, capacity: str) -> None:
    """The legend of the blocks chart sits outside its axes, clear of the stacked areas and of
    the capacity named above them."""
    used = _set_capacity(serving_run, 0)
    _set_capacity(serving_run, used + 5 if capacity == "near" else 1_000_000)
    fig = plots.timeline(serving_run)
    renderer = rendered(fig)
    blocks = fig.axes[0]
    legend = blocks.get_legend()
    box = legend.get_window_extent(renderer)
    assert not box.overlaps(blocks.get_window_extent(renderer))
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    title = blocks.title if capacity == "near" else blocks._right_title
    if title.get_text():
        assert not box.overlaps(title.get_window_extent(renderer))
