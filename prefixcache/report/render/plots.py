"""Plots of one run, drawn with matplotlib (imported by the HTML renderer only when needed);
the colours and figure helpers the sweep plots (``sweep_plots``) share.

Each plot takes a loaded, validated ``Run`` and returns a new matplotlib ``Figure`` (sizes in
inches); ``RUN_PLOTS`` names them as report sections list them. Importing this module without
matplotlib raises ModuleNotFoundError, which the HTML renderer turns into
MissingDependencyError.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FuncFormatter,
    MaxNLocator,
    PercentFormatter,
)

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.report.figures import (
    hit_ratio_histogram,
    ratio_percentiles,
    request_hit_ratios,
    timeline_in_seconds,
    ttft_samples,
)
from prefixcache.report.run_dir import Run
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
HEADROOM = 1.15  # the block axis of the timeline extends this far above the blocks in use
WIDE, NARROW = (11.0, 3.4), (6.4, 3.4)  # figure sizes (width, height) in inches


def new_figure(size: tuple[float, float] = NARROW, rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure of ``size`` (width, height) inches with ``rows`` axes stacked on one shared x
    axis, each with a light grid and no top or right spine; returns it and its axes."""
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    return fig, list(axes)


def png_base64(fig: Figure, dpi: int = 144) -> str:
    """``fig`` as a PNG at ``dpi`` dots per inch on white, base64-encoded (ASCII)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def headline(run: Run) -> Figure:
    """Block and token hit rate as bars, over the infinite cache's upper bounds when the run
    has both."""
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
    """Histogram of the requests' hit ratios (hit tokens / prompt tokens, requests with a
    prompt), with the p50, p90 and p99 ratios as lines."""
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
    """Missed prompt tokens by cause, as bars labelled with their count and share."""
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
    """Indices of at most ``MAX_POINTS`` of ``n`` samples, evenly spread, both ends included."""
    return np.linspace(0, n - 1, min(n, MAX_POINTS)).astype(np.int64)


def timeline(run: Run) -> Figure:
    """The run over time, in three panels: blocks active and cached (with the capacity, all
    replicas together), cumulative evicted blocks, and the cumulative and rolling token hit
    rate (with the upper bound). The x axis is simulated seconds for a serving run, else
    requests replayed."""
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
    replicas = int(r["config"].get("replicas") or 1)
    blocks.set_ylabel(f"blocks\n({replicas} replicas)" if replicas > 1 else "blocks")
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
    """A tick label with thousands separators: 12,500 (two significant digits when not whole)."""
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
    """The distribution (CDF) of estimated time to first token with and without the cache,
    over the requests that have both, in ms or s (``ttft_unit``)."""
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


def compact_count(value: float, _pos: object = None) -> str:
    """A capacity as a short tick label: 512, 4,096, 16k, 1.5M."""
    if value < 10_000:
        return f"{value:,.0f}"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:,.0f}"  # pragma: no cover - every value reaches the k branch


RUN_PLOTS: dict[str, Callable[[Run], Figure]] = {
    "headline": headline,
    "hit_ratio_histogram": hit_ratio_histogram_plot,
    "misses": misses,
    "timeline": timeline,
    "ttft": ttft,
}
