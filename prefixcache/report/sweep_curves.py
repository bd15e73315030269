"""Capacity, block-size and policy sweeps: grouping into curves and finding the knee."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixcache.run_format import MISS_CAUSES

# Keys that identify a sweep point besides its capacity; others are measurements. A curve of hit
# rate against capacity holds the points that agree on all of them.
VARIANT_KEYS = ("block_size", "policy", "host_blocks", "pool_blocks", "replicas", "routing")
BASE_KEYS = ("capacity_blocks", "token_hit_rate", "block_hit_rate", "evicted_blocks")
MISS_KEYS = ("misses", "prompt_tokens")  # shown as one column per miss cause
LOG_X_SPAN = 16  # capacities spanning this factor or more are read on a log axis

Point = dict[str, Any]


def varying(points: Sequence[Point], key: str) -> bool:
    """True when ``key`` takes more than one value across the sweep."""
    return len({p.get(key) for p in points}) > 1


# what a sweep point's keys are called in tables, in the order the extra ones are shown
SWEEP_LABELS: dict[str, str] = {
    "capacity_blocks": "Capacity (blocks)",
    "block_size": "Block size (tokens)",
    "policy": "Eviction policy",
    "host_blocks": "Host tier (blocks)",
    "pool_blocks": "Shared pool (blocks)",
    "replicas": "Replicas",
    "routing": "Routing",
    "upper_bound_token_hit_rate": "Infinite cache: token hit rate",
    "gpu_token_hit_rate": "Hits on GPU",
    "host_token_hit_rate": "Hits loaded from the host tier",
    "pool_token_hit_rate": "Hits loaded from the shared pool",
    "pooled_token_hit_rate": "One replica of the fleet's size: token hit rate",
    "routing_miss_tokens": "Routing-miss tokens",
    "load_imbalance": "Load imbalance (max / mean busy)",
    "ttft_p50_s": "TTFT p50",
    "ttft_p99_s": "TTFT p99",
    "overloaded": "Arrivals outrun the GPUs",
    "rejected_requests": "Rejected requests",
}


def sweep_label(key: str) -> str:
    """The table header of a sweep point's ``key``."""
    return SWEEP_LABELS.get(key) or key.replace("_", " ").capitalize()


def extra_keys(points: Sequence[Point]) -> list[str]:
    """The keys of the points beyond capacity, the variants, the hit rates and the misses: the
    labelled ones in ``SWEEP_LABELS``'s order, then any other alphabetically."""
    known = set(BASE_KEYS) | set(VARIANT_KEYS) | set(MISS_KEYS)
    extra = {k for p in points for k in p if k not in known}
    order = {k: i for i, k in enumerate(SWEEP_LABELS)}
    return sorted(extra, key=lambda k: (order.get(k, len(order)), k))


def miss_causes(points: Sequence[Point]) -> list[str]:
    """The miss causes a sweep table shows: cold and capacity whenever the points carry their
    misses, the other causes where some point has them."""
    if not any(isinstance(p.get("misses"), dict) for p in points):
        return []
    return [
        c
        for c in MISS_CAUSES
        if c in ("cold", "capacity") or any((p.get("misses") or {}).get(c) for p in points)
    ]


def miss_share(point: Point, cause: str) -> float | None:
    """Missed tokens of ``cause`` as a share of the point's prompt tokens (None when unknown)."""
    misses, prompt = point.get("misses"), point.get("prompt_tokens")
    if not isinstance(misses, dict) or cause not in misses or not prompt:
        return None
    return float(misses[cause]) / float(prompt)


def _label(point: Point, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {point.get(k)}" for k in keys)


def series(points: Sequence[Point], x: str, by: Sequence[str]) -> dict[str, list[Point]]:
    """Points grouped by the values of ``by`` (in first-seen order), each group sorted by ``x``."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(_label(p, by), []).append(p)
    return {k: sorted(v, key=lambda p: sort_key(p.get(x))) for k, v in groups.items()}


def sort_key(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def use_log_x(xs: Sequence[float]) -> bool:
    lo, hi = min(xs), max(xs)
    return lo > 0 and hi / lo >= LOG_X_SPAN


def knee_index(xs: Sequence[float], ys: Sequence[float], log_x: bool) -> int | None:
    """Index of the point furthest above the chord joining the curve's ends (Kneedle).

    None when there are fewer than three points or no point lies above the chord.
    """
    if len(xs) < 3:
        return None
    x = np.log2(np.asarray(xs, dtype=np.float64)) if log_x else np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x[-1] == x[0] or y[-1] == y[0]:
        return None
    xn = (x - x[0]) / (x[-1] - x[0])
    yn = (y - y[0]) / (y[-1] - y[0])
    gap = yn - xn
    best = int(np.argmax(gap))
    return best if gap[best] > 1e-9 else None


def capacity_knees(points: Sequence[Point]) -> dict[str, Point]:
    """The knee of each hit-rate-vs-capacity curve, by curve label."""
    by = [k for k in VARIANT_KEYS if varying(points, k)]
    log_x = use_log_x([p["capacity_blocks"] for p in points]) if points else False
    out: dict[str, Point] = {}
    for label, curve in series(points, "capacity_blocks", by).items():
        i = knee_index(
            [p["capacity_blocks"] for p in curve], [p["token_hit_rate"] for p in curve], log_x
        )
        if i is not None:
            out[label] = curve[i]
    return out
