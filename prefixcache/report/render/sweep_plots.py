"""Plots of a run's sweep: hit rate against capacity, block size and policy, drawn with
matplotlib (imported by the HTML renderer only when needed).

Each takes a loaded ``Run`` whose report has a non-empty ``sweep`` (the sweep section lists
them only then) and returns a new ``Figure``; ``SWEEP_PLOTS`` names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    MaxNLocator,
    NullLocator,
    PercentFormatter,
)
from matplotlib.transforms import blended_transform_factory
from numpy.typing import ArrayLike

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.report import formatting as fmt
from prefixcache.report.render.plots import BLUE, GREY, NARROW, RED, WIDE, compact_count, new_figure
from prefixcache.report.run_dir import Run
from prefixcache.report.sweep_curves import (
    VARIANT_KEYS,
    capacity_knees,
    series,
    use_log_x,
    varying,
)

MAX_CAPACITY_TICKS = 8  # labelled capacities on a sweep's x axis; the others are unlabelled ticks


def _points(run: Run) -> list[dict[str, Any]]:
    """The sweep's points (report rows), a new list; empty when the run has no sweep."""
    return list(run.report["sweep"] or [])


def capacity(run: Run) -> Figure:
    """Token hit rate against capacity in blocks, a curve per combination of the other swept
    settings (``VARIANT_KEYS``) with each curve's knee marked; the upper bound when the block
    size is not swept, this run's capacity, and unbounded caches as markers at the right edge.
    A sweep at one capacity whose other settings vary is drawn as bars instead."""
    points = _points(run)
    by = [k for k in VARIANT_KEYS if varying(points, k)]
    if by and not varying(points, "capacity_blocks"):  # one capacity: nothing to draw along it
        return _variant_bars(run, points, by)
    fig, (ax,) = new_figure(WIDE if by else NARROW)
    # an unbounded cache (--blocks inf) has no place on a capacity axis: drawn apart, at the edge
    finite = [p for p in points if p["capacity_blocks"] < UNBOUNDED]
    curves = series(finite, "capacity_blocks", by)
    knees = capacity_knees(finite)
    colors: dict[str, Any] = {}
    for label, curve in curves.items():
        xs = [p["capacity_blocks"] for p in curve]
        (line,) = ax.plot(
            xs,
            [p["token_hit_rate"] for p in curve],
            marker="o",
            markersize=3,
            label=label or "token hit rate",
        )
        colors[label] = line.get_color()
        if label in knees:
            k = knees[label]
            ax.plot(
                k["capacity_blocks"],
                k["token_hit_rate"],
                marker="D",
                markersize=9,
                markerfacecolor="none",
                markeredgecolor=RED,
                markeredgewidth=2,
            )
            if not by:
                ax.annotate(
                    f"knee: {k['capacity_blocks']:,} blocks",
                    (k["capacity_blocks"], k["token_hit_rate"]),
                    xytext=(10, -18),
                    textcoords="offset points",
                    color=RED,
                    gid="knee_label",
                )
    _upper_bound_line(ax, run, points)
    if run.report["config"]["capacity_blocks"] < UNBOUNDED:
        ax.axvline(
            run.report["config"]["capacity_blocks"],
            color=GREY,
            linestyle=":",
            label="this run's capacity",
        )
    _unbounded_points(ax, [p for p in points if p["capacity_blocks"] >= UNBOUNDED], by, colors)
    ax.plot(
        [],
        [],
        marker="D",
        markerfacecolor="none",
        markeredgecolor=RED,
        linestyle="none",
        label="knee",
    )
    if finite:
        _capacity_axis(ax, sorted({p["capacity_blocks"] for p in finite}))
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate")
    miss = ax.secondary_yaxis("right", functions=(_complement, _complement))
    miss.yaxis.set_major_formatter(PercentFormatter(1.0))
    miss.set_ylabel("miss ratio")
    if by:  # one curve per variant: the legend goes beside, right of the miss-ratio axis
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.1, 1.0))
    else:  # below the axes, clear of the curve and the knee's label
        fig.legend(fontsize="small", loc="outside lower center", ncols=2, frameon=False)
    return fig


def _variant_bars(run: Run, points: list[dict[str, Any]], by: list[str]) -> Figure:
    """A sweep at one capacity (routing policies of a fleet, say): a bar per sweep point."""
    fig, (ax,) = new_figure()
    curves = series(points, "capacity_blocks", by)
    names = [
        ", ".join(str(curve[0].get(k)) for k in by) for curve in curves.values()
    ]  # the values only: the axis label names the settings
    rates = [curve[0]["token_hit_rate"] for curve in curves.values()]
    x = np.arange(len(names))
    ax.bar(x, rates, 0.6, color=BLUE, label="token hit rate")
    for xi, rate in zip(x, rates, strict=True):
        ax.annotate(
            fmt.pct(rate),
            (xi, rate),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize="small",
        )
    ax.set_xticks(x, names, rotation=30 if len(names) > 4 else 0)
    _upper_bound_line(ax, run, points)
    ax.set_ylim(0, 1.08)
    ax.yaxis.set_major_locator(FixedLocator([0, 0.2, 0.4, 0.6, 0.8, 1.0]))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(", ".join(k.replace("_", " ") for k in by))
    ax.set_ylabel("token hit rate")
    ax.set_title(f"capacity {fmt.capacity_blocks(points[0]['capacity_blocks'])}", fontsize="medium")
    fig.legend(fontsize="small", loc="outside lower center", ncols=2, frameon=False)
    return fig


def _upper_bound_line(ax: Axes, run: Run, points: list[dict[str, Any]]) -> None:
    """The infinite cache's hit rate, dashed, where the points share one block size."""
    bound = run.report["upper_bound_token_hit_rate"]
    if bound is not None and not varying(points, "block_size"):
        ax.axhline(bound, color=GREY, linestyle="--", label="upper bound (infinite cache)")


def _unbounded_points(
    ax: Axes, points: list[dict[str, Any]], by: list[str], colors: dict[str, Any]
) -> None:
    """Sweep points of an unbounded cache: a marker per curve at the right edge of the axes,
    at its hit rate, labelled "unbounded" (with the rate when there is one curve)."""
    if not points:
        return
    edge = blended_transform_factory(ax.transAxes, ax.transData)
    rates = []
    for label, curve in series(points, "capacity_blocks", by).items():
        rate = curve[0]["token_hit_rate"]
        rates.append(rate)
        ax.plot(
            [0.97],
            [rate],
            marker=">",
            markersize=8,
            linestyle="none",
            color=colors.get(label, GREY),
            transform=edge,
            clip_on=False,
        )
    text = f"unbounded: {fmt.pct(rates[0])}" if len(rates) == 1 else "unbounded"
    below = max(rates) > 0.8  # inside the axes, which end at 100%
    ax.annotate(
        text,
        (0.95, min(rates) if below else max(rates)),
        xycoords=edge,
        xytext=(0, -8 if below else 8),
        textcoords="offset points",
        ha="right",
        va="top" if below else "bottom",
        fontsize="small",
        gid="unbounded_label",
    )


def _capacity_axis(ax: Axes, capacities: list[int]) -> None:
    """Ticks at the swept capacities, at most MAX_CAPACITY_TICKS of them labelled (evenly
    spread, first and last included), in a compact format; other capacities get unlabelled
    ticks."""
    if use_log_x(capacities):
        ax.set_xscale("log", base=2)
        step = -(-len(capacities) // MAX_CAPACITY_TICKS)
        labelled = capacities[::step]
        if labelled[-1] != capacities[-1]:
            labelled[-1] = capacities[-1]
        ax.xaxis.set_major_locator(FixedLocator(labelled))
        ax.xaxis.set_minor_locator(FixedLocator([c for c in capacities if c not in labelled]))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda _v, _p: ""))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=MAX_CAPACITY_TICKS, integer=True))
        ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(compact_count))
    if len(ax.get_xticks()) > 6:
        ax.tick_params(axis="x", labelrotation=30)


def block_size(run: Run) -> Figure:
    """Token hit rate against block size (log2 axis), one line per capacity, for the policy of
    the sweep's first point."""
    points = _points(run)
    policy = points[0].get("policy")
    chosen = [p for p in points if p.get("policy") == policy]
    fig, (ax,) = new_figure()
    curves = series(chosen, "block_size", ["capacity_blocks"])
    colors = _ramp(len(curves))
    for (label, curve), color in zip(curves.items(), colors, strict=True):
        ax.plot(
            [p["block_size"] for p in curve],
            [p["token_hit_rate"] for p in curve],
            marker="o",
            markersize=3,
            color=color,
            label=label.replace("capacity blocks ", ""),
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        sorted({p["block_size"] for p in chosen}),
        [str(b) for b in sorted({p["block_size"] for p in chosen})],
    )
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"policy {policy}" if policy is not None else "", fontsize="medium")
    ax.legend(
        title="capacity (blocks)",
        fontsize="x-small",
        title_fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    return fig


def policy(run: Run) -> Figure:
    """Token hit rate per policy at each capacity, as grouped bars, for the block size of the
    sweep's first point (a missing point draws as 0)."""
    points = _points(run)
    size = points[0].get("block_size")
    chosen = [p for p in points if p.get("block_size") == size]
    policies = list(dict.fromkeys(p["policy"] for p in chosen))
    capacities = sorted({p["capacity_blocks"] for p in chosen})
    rate = {(p["policy"], p["capacity_blocks"]): p["token_hit_rate"] for p in chosen}
    fig, (ax,) = new_figure()
    width = 0.8 / len(policies)
    x = np.arange(len(capacities))
    for i, pol in enumerate(policies):
        ax.bar(
            x + i * width - 0.4 + width / 2,
            [rate.get((pol, c), 0.0) for c in capacities],
            width,
            label=str(pol),
        )
    step = -(-len(capacities) // MAX_CAPACITY_TICKS)
    ax.set_xticks(
        x[::step],
        [compact_count(c) for c in capacities[::step]],
        rotation=30 if len(x[::step]) > 6 else 0,
    )
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"block size {size}" if size is not None else "", fontsize="medium")
    ax.legend(title="policy", fontsize="small")
    return fig


def _complement(y: ArrayLike) -> np.ndarray:
    """``1 - y``: hit rate to miss ratio and back, for the secondary axis."""
    return 1 - np.asarray(y)


def _ramp(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` RGBA colours (at least one) along viridis, dark to light."""
    cmap = colormaps["viridis"]
    return [cmap(v) for v in np.linspace(0.05, 0.85, max(n, 1))]


SWEEP_PLOTS: dict[str, Callable[[Run], Figure]] = {
    "sweep_capacity": capacity,
    "sweep_block_size": block_size,
    "sweep_policy": policy,
}
