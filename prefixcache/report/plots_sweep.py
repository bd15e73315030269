"""Sweep plots: the miss-ratio curve with its knee, and hit rate against block size and policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from prefixcache.report.plots import GREY, NARROW, RED, WIDE, new_figure
from prefixcache.report.run import Run
from prefixcache.report.sweep import VARIANT_KEYS, capacity_knees, series, use_log_x, varying


def _points(run: Run) -> list[dict[str, Any]]:
    return list(run.report["sweep"] or [])


def capacity(run: Run) -> Figure:
    points = _points(run)
    by = [k for k in VARIANT_KEYS if varying(points, k)]
    fig, (ax,) = new_figure(WIDE if by else NARROW)
    curves = series(points, "capacity_blocks", by)
    knees = capacity_knees(points)
    for label, curve in curves.items():
        xs = [p["capacity_blocks"] for p in curve]
        ax.plot(
            xs,
            [p["token_hit_rate"] for p in curve],
            marker="o",
            markersize=3,
            label=label or "token hit rate",
        )
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
                )
    if not varying(points, "block_size"):
        ax.axhline(
            run.report["upper_bound_token_hit_rate"],
            color=GREY,
            linestyle="--",
            label="upper bound (infinite cache)",
        )
    ax.axvline(
        run.report["config"]["capacity_blocks"],
        color=GREY,
        linestyle=":",
        label="this run's capacity",
    )
    ax.plot(
        [],
        [],
        marker="D",
        markerfacecolor="none",
        markeredgecolor=RED,
        linestyle="none",
        label="knee",
    )
    capacities = sorted({p["capacity_blocks"] for p in points})
    if use_log_x(capacities):
        ax.set_xscale("log", base=2)
        ax.set_xticks(capacities, [f"{c:,}" for c in capacities], minor=False)
        ax.tick_params(axis="x", which="minor", bottom=False)
        if len(capacities) > 6:
            ax.tick_params(axis="x", labelrotation=45)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate")
    miss = ax.secondary_yaxis("right", functions=(_complement, _complement))
    miss.yaxis.set_major_formatter(PercentFormatter(1.0))
    miss.set_ylabel("miss ratio")
    if by:  # one curve per variant: the legend goes beside, right of the miss-ratio axis
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.1, 1.0))
    else:
        ax.legend(fontsize="small", loc="lower right")
    return fig


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
    ax.set_xticks(x, [f"{c:,}" for c in capacities], rotation=45 if len(capacities) > 6 else 0)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"block size {size}" if size is not None else "", fontsize="medium")
    ax.legend(title="policy", fontsize="small")
    return fig


def _complement(y: np.ndarray) -> np.ndarray:
    return 1 - y


def _ramp(n: int) -> list[tuple[float, float, float, float]]:
    cmap = colormaps["viridis"]
    return [cmap(v) for v in np.linspace(0.05, 0.85, max(n, 1))]


SWEEP_PLOTS: dict[str, Callable[[Run], Figure]] = {
    "sweep_capacity": capacity,
    "sweep_block_size": block_size,
    "sweep_policy": policy,
}
