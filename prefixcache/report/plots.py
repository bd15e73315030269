"""Plots of one run and of its sweep, drawn with matplotlib (imported by the HTML renderer only
when needed)."""

from __future__ import annotations

import base64
import io
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
from prefixcache.report.figures import (
    hit_ratio_histogram,
    ratio_percentiles,
    request_hit_ratios,
    timeline_in_seconds,
    ttft_samples,
)
from prefixcache.report.run_dir import Run
from prefixcache.report.sweep_curves import (
    VARIANT_KEYS,
    capacity_knees,
    series,
    use_log_x,
    varying,
)
from prefixcache.run_format import MISS_CAUSES

BLUE, ORANGE, GREEN, RED, PURPLE, GREY = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#7f7f7f",
)
MISS_COLORS = dict(zip(MISS_CAUSES, (BLUE, ORANGE, GREEN, RED, PURPLE), strict=True))
MAX_POINTS = 4000  # timeline samples drawn; longer timelines are thinned evenly
MAX_CAPACITY_TICKS = 8  # labelled capacities on a sweep's x axis; the others are unlabelled ticks
HEADROOM = 1.15  # the block axis of the timeline extends this far above the blocks in use
WIDE, NARROW = (11.0, 3.4), (6.4, 3.4)


def new_figure(size: tuple[float, float] = NARROW, rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    return fig, list(axes)


def png_base64(fig: Figure, dpi: int = 144) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def headline(run: Run) -> Figure:
    r = run.report
    fig, (ax,) = new_figure((6.4, 2.2))
    names = ["Block hit rate", "Token hit rate"]
    rates = [r["block_hit_rate"], r["token_hit_rate"]]
    bounds = [r["upper_bound_block_hit_rate"], r["upper_bound_token_hit_rate"]]
    if None not in bounds:
        ax.barh(
            names, bounds, color="#d9e6f2", edgecolor=BLUE, label="upper bound (infinite cache)"
        )
    ax.barh(names, rates, color=BLUE, height=0.5, label="achieved")
    for y, (rate, bound) in enumerate(zip(rates, bounds, strict=True)):
        of = f" of {bound:.1%}" if bound is not None else ""
        ax.text(max(bound or 0.0, rate) + 0.01, y, f"{rate:.1%}{of}", va="center")
    ax.set_xlim(0, 1.2)  # room for the labels right of the bars
    ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])  # no tick past 100%
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.legend(
        loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, fontsize="small", frameon=False
    )
    return fig


def hit_ratio_histogram_plot(run: Run) -> Figure:
    ratios = request_hit_ratios(run)
    hist = hit_ratio_histogram(ratios)
    fig, (ax,) = new_figure()
    ax.bar(
        hist.edges[:-1],
        hist.counts,
        width=np.diff(hist.edges),
        align="edge",
        color=BLUE,
        edgecolor="white",
    )
    for (q, value), color in zip(
        ratio_percentiles(ratios).items(), (GREEN, ORANGE, RED), strict=True
    ):
        ax.axvline(value, color=color, linestyle="--", label=f"p{q} = {value:.1%}")
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("hit tokens / prompt tokens")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")
    return fig


def misses(run: Run) -> Figure:
    m = run.report["misses"]
    fig, (ax,) = new_figure((6.4, 2.8))
    total = sum(m.values()) or 1
    ax.barh(
        list(reversed(MISS_CAUSES)),
        [m[c] for c in reversed(MISS_CAUSES)],
        color=[MISS_COLORS[c] for c in reversed(MISS_CAUSES)],
    )
    for y, c in enumerate(reversed(MISS_CAUSES)):
        ax.text(m[c], y, f" {m[c]:,} ({m[c] / total:.1%})", va="center", fontsize="small")
    ax.set_xlim(0, max(m.values(), default=0) * 1.35 or 1)
    ax.xaxis.set_major_formatter(FuncFormatter(compact_count))  # 2.5M, not an x1e6 offset
    ax.set_xlabel("missed prompt tokens")
    return fig


def _thin(n: int) -> np.ndarray:
    return np.linspace(0, n - 1, min(n, MAX_POINTS)).astype(np.int64)


def timeline(run: Run) -> Figure:
    tl, r = run.timeline, run.report
    idx = _thin(len(tl["t"]))
    t = tl["t"][idx]
    fig, (blocks, evictions, rate) = new_figure((11.0, 6.6), rows=3)
    active, cached = tl["blocks_active"][idx], tl["blocks_cached"][idx]
    blocks.stackplot(t, active, cached, labels=["active", "cached"], colors=[BLUE, ORANGE])
    capacity = int(r["config"]["capacity_blocks"])
    if capacity < UNBOUNDED:  # an unbounded cache has no capacity to mark
        # a fleet's timeline adds up its replicas, and so does its capacity
        capacity *= int(r["config"].get("replicas") or 1)
        _capacity_line(blocks, capacity, int((active + cached).max(initial=0)))
    blocks.set_ylabel("blocks")
    blocks.yaxis.set_major_formatter(FuncFormatter(_thousands))
    # above the axes, left (the capacity may be named on the right): the areas stay uncovered
    blocks.legend(
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncols=3,
        fontsize="small",
        frameon=False,
        borderaxespad=0.2,
    )
    evictions.plot(t, tl["evicted_blocks_cum"][idx], color=RED)
    evictions.set_ylim(bottom=0)
    evictions.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    evictions.yaxis.set_major_formatter(FuncFormatter(_thousands))
    evictions.set_ylabel("evicted blocks\n(cumulative)")
    cumulative = tl["hit_tokens_cum"] / np.maximum(tl["prompt_tokens_cum"], 1)
    rate.plot(t, cumulative[idx], color=GREEN, linewidth=2.5, alpha=0.6, label="cumulative")
    rate.plot(t, tl["rolling_token_hit_rate"][idx], color=BLUE, linewidth=1, label="rolling")
    if r["upper_bound_token_hit_rate"] is not None:
        rate.axhline(
            r["upper_bound_token_hit_rate"],
            color=GREY,
            linestyle="--",
            label="upper bound (whole run)",
        )
    rate.set_ylim(0, 1)
    rate.yaxis.set_major_formatter(PercentFormatter(1.0))
    rate.set_ylabel("token hit rate")
    rate.set_xlabel("simulated time (s)" if timeline_in_seconds(run) else "requests replayed")
    rate.legend(loc="lower right", ncols=3, fontsize="small")
    return fig


def _capacity_line(ax: Axes, capacity: int, used: int) -> None:
    """Scale the block axis to the blocks in use; mark the capacity as a line when it fits
    there, otherwise name it above the axis."""
    top = max(used * HEADROOM, 1.0)
    if capacity <= top:
        top = capacity * 1.05
        ax.axhline(capacity, color=GREY, linestyle="--", linewidth=1, label="capacity")
    else:
        ax.set_title(
            f"capacity {capacity:,} blocks, above this scale (peak in use {used:,})",
            fontsize="small",
            loc="right",
            color=GREY,
        )
    ax.set_ylim(0, top)


def _thousands(value: float, _pos: object = None) -> str:
    return f"{value:,.0f}" if value == round(value) else f"{value:,.2g}"


def ttft_unit(seconds: np.ndarray) -> tuple[str, float]:
    """Milliseconds for sub-second latencies, seconds otherwise: (unit, factor from seconds)."""
    top = float(np.max(seconds, initial=0.0))
    return ("ms", 1000.0) if top < 1.0 else ("s", 1.0)


def _plain(value: float, _pos: object = None) -> str:
    """A tick label without offset or scientific notation: 1,250 or 0.25."""
    if value == round(value):
        return f"{value:,.0f}"
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def ttft(run: Run) -> Figure:
    cached, nocache = ttft_samples(run)
    fig, (ax,) = new_figure()
    unit, factor = ttft_unit(np.concatenate([cached, nocache]))
    for values, label, color in ((nocache, "no cache", GREY), (cached, "with cache", BLUE)):
        xs = np.sort(values) * factor
        ax.step(
            xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post", label=label, color=color
        )
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.set_xlabel(f"estimated time to first token ({unit})")
    ax.set_ylabel("requests at or below")
    ax.legend(fontsize="small", loc="lower right")
    return fig


RUN_PLOTS: dict[str, Callable[[Run], Figure]] = {
    "headline": headline,
    "hit_ratio_histogram": hit_ratio_histogram_plot,
    "misses": misses,
    "timeline": timeline,
    "ttft": ttft,
}


# ---- sweeps ------------------------------------------------------------------------------------


def _points(run: Run) -> list[dict[str, Any]]:
    return list(run.report["sweep"] or [])


def capacity(run: Run) -> Figure:
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
    if not varying(points, "block_size") and run.report["upper_bound_token_hit_rate"] is not None:
        ax.axhline(
            run.report["upper_bound_token_hit_rate"],
            color=GREY,
            linestyle="--",
            label="upper bound (infinite cache)",
        )
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
    if run.report["upper_bound_token_hit_rate"] is not None and not varying(points, "block_size"):
        ax.axhline(
            run.report["upper_bound_token_hit_rate"],
            color=GREY,
            linestyle="--",
            label="upper bound (infinite cache)",
        )
    ax.set_ylim(0, 1.08)
    ax.yaxis.set_major_locator(FixedLocator([0, 0.2, 0.4, 0.6, 0.8, 1.0]))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(", ".join(k.replace("_", " ") for k in by))
    ax.set_ylabel("token hit rate")
    ax.set_title(f"capacity {fmt.capacity_blocks(points[0]['capacity_blocks'])}", fontsize="medium")
    fig.legend(fontsize="small", loc="outside lower center", ncols=2, frameon=False)
    return fig


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


def compact_count(value: float, _pos: object = None) -> str:
    """A capacity as a short tick label: 512, 4,096, 16k, 1.5M."""
    if value < 10_000:
        return f"{value:,.0f}"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:,.0f}"  # pragma: no cover - every value reaches the k branch


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
    """Hit rate against block size, one line per capacity, for the first policy swept."""
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
    """Hit rate per policy at each capacity, for the first block size swept."""
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
    return 1 - np.asarray(y)


def _ramp(n: int) -> list[tuple[float, float, float, float]]:
    cmap = colormaps["viridis"]
    return [cmap(v) for v in np.linspace(0.05, 0.85, max(n, 1))]


SWEEP_PLOTS: dict[str, Callable[[Run], Figure]] = {
    "sweep_capacity": capacity,
    "sweep_block_size": block_size,
    "sweep_policy": policy,
}
