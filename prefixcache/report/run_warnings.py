"""What a report must say before any figure: an overloaded GPU, rejected requests, an assumed
model. The terminal summary, Markdown and HTML print the same lines."""

from __future__ import annotations

from typing import Any


def run_warnings(report: dict[str, Any]) -> list[str]:
    """The warnings of a report.json, most serious first."""
    out: list[str] = []
    serving = report.get("serving")
    if serving:
        overload = overload_warning(serving)
        if overload:
            out.append(overload)
    rejected = report.get("rejected_requests") or 0
    if rejected:
        cfg = report["config"]
        total = report["requests"] or 1
        out.append(
            f"{rejected:,} of {report['requests']:,} requests ({100 * rejected / total:.1f}%) "
            f"were rejected: each prompt needs more than the whole cache "
            f"({cfg['capacity_blocks']:,} blocks of {cfg['block_size']} tokens = "
            f"{cfg['capacity_blocks'] * cfg['block_size']:,} tokens) and was never served; "
            "its tokens count as misses. Raise --blocks or --block-size"
        )
    truncated = report.get("truncated_outputs") or 0
    if truncated:
        out.append(
            f"{truncated:,} requests stopped generating early: alone in the cache, their prompt "
            "plus output outgrew it"
        )
    points = (report.get("sweep") or [])[1:]  # the first point is the report itself
    rejecting = [p for p in points if p.get("rejected_requests")]
    if rejecting:
        listed = "; ".join(f"{_point(p)} ({p['rejected_requests']:,} rejected)" for p in rejecting)
        out.append(f"other sweep points rejected requests: {listed}")
    overloaded = [p for p in points if p.get("overloaded")]
    if overloaded:
        out.append(
            f"{len(overloaded)} other sweep points are overloaded (TTFT reflects queueing): "
            + "; ".join(_point(p) for p in overloaded)
        )
    cfg = report.get("config") or {}
    if cfg.get("model_defaulted"):
        out.append(
            f"no --model given: {cfg['model']} assumed for KV bytes and step times; pass --model"
        )
    return out


def _point(point: dict[str, Any]) -> str:
    """A sweep point's setup: the keys that vary in sweeps."""
    return ", ".join(
        f"{key.replace('_', ' ')} {point[key]}"
        for key in (
            "capacity_blocks",
            "block_size",
            "policy",
            "replicas",
            "routing",
            "host_blocks",
            "pool_blocks",
        )
        if point.get(key) is not None
    )


def overload_warning(serving: dict[str, Any]) -> str | None:
    """The warning a report prints for a report.json ``serving`` section, or None."""
    load = serving.get("load") or {}
    if not load.get("overloaded"):
        return None
    scale = load.get("sustainable_rate_scale_estimate")
    hint = f"; try --rate-scale {scale:.2g} or less" if scale else ""
    if load.get("replicas", 1) > 1:
        who, busy, offered = (
            "the busiest replica",
            load["busiest_replica_busy_s"],
            load["offered_load_busiest"],
        )
    else:
        who, busy, offered = "the GPU", load["busy_s"], load["offered_load"]
    return (
        f"OVERLOADED: {who} needs {busy:,.0f} s of work for "
        f"{load['arrival_span_s']:,.0f} s of arrivals (offered load {offered:.2f}x); "
        f"the queue grows without bound, so TTFT reflects queueing, not prefill{hint}"
    )
