"""Figures derived from a run's per-request and timeline data (the rest come from report.json)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixcache.report.run_dir import Run
from prefixcache.run_format import PERCENTILES, nearest_rank

HISTOGRAM_BINS = 10


def request_hit_ratios(run: Run) -> np.ndarray:
    prompt = run.requests["prompt_tokens"].astype(np.float64)
    hits = run.requests["hit_tokens"].astype(np.float64)
    keep = prompt > 0
    return hits[keep] / prompt[keep]


@dataclass(frozen=True)
class Histogram:
    edges: np.ndarray  # HISTOGRAM_BINS + 1 edges over [0, 1]; the last bin includes 1.0
    counts: np.ndarray


def hit_ratio_histogram(ratios: np.ndarray) -> Histogram:
    counts, edges = np.histogram(ratios, bins=HISTOGRAM_BINS, range=(0.0, 1.0))
    return Histogram(edges=edges, counts=counts)


def ratio_percentiles(ratios: np.ndarray) -> dict[int, float]:
    return {q: nearest_rank(ratios, q) for q in PERCENTILES}


def timeline_in_seconds(run: Run) -> bool:
    """Serving runs sample the timeline in simulated seconds; sequential runs by request index."""
    return run.report["serving"] is not None


@dataclass(frozen=True)
class TimelineSummary:
    start: float  # first and last sample of t (seconds or request index)
    end: float
    peak_active: int
    peak_cached: int
    min_free: int
    final_active: int
    final_cached: int
    final_free: int
    evicted: int
    rolling_first: float  # rolling hit rate at the first sample
    rolling_final: float
    warm_up: float | None  # in units of t; None when the rate stays zero


def timeline_summary(run: Run) -> TimelineSummary | None:
    tl = run.timeline
    if len(tl["t"]) == 0:
        return None
    t = tl["t"].astype(np.float64)
    rolling = tl["rolling_token_hit_rate"].astype(np.float64)
    final = float(rolling[-1])
    warm: float | None = None
    if final > 0:
        reached = np.nonzero(rolling >= 0.9 * final)[0]
        warm = float(t[reached[0]] - t[0])
    return TimelineSummary(
        start=float(t[0]),
        end=float(t[-1]),
        peak_active=int(tl["blocks_active"].max()),
        peak_cached=int(tl["blocks_cached"].max()),
        min_free=int(tl["blocks_free"].min()),
        final_active=int(tl["blocks_active"][-1]),
        final_cached=int(tl["blocks_cached"][-1]),
        final_free=int(tl["blocks_free"][-1]),
        evicted=int(tl["evicted_blocks_cum"][-1]),
        rolling_first=float(rolling[0]),
        rolling_final=final,
        warm_up=warm,
    )


def achieved(rate: float, bound: float | None) -> float | None:
    """Hit rate as a fraction of its upper bound; None when the bound is zero or unknown."""
    return rate / bound if bound is not None and bound > 0 else None


def ttft_samples(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Estimated TTFT with and without the cache, requests that have both."""
    with_cache = run.requests["ttft_s"].astype(np.float64)
    without = run.requests["ttft_nocache_s"].astype(np.float64)
    keep = np.isfinite(with_cache) & np.isfinite(without)
    return with_cache[keep], without[keep]
