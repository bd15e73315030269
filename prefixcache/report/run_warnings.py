"""What a report must say before any figure: an overloaded GPU, rejected requests, an assumed
model. The terminal summary, Markdown and HTML print the same lines."""

from __future__ import annotations

from typing import Any

from prefixcache.replay.serving_figures import overload_warning


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
    for point in (report.get("sweep") or [])[1:]:  # the first point is the report itself
        problems = []
        if point.get("rejected_requests"):
            problems.append(f"{point['rejected_requests']:,} requests rejected")
        if point.get("overloaded"):
            problems.append("overloaded")
        if problems:
            where = ", ".join(
                f"{key} {point[key]}"
                for key in ("capacity_blocks", "block_size", "policy", "replicas", "routing")
                if point.get(key) is not None
            )
            out.append(f"sweep point ({where}): {' and '.join(problems)}")
    cfg = report.get("config") or {}
    if cfg.get("model_defaulted"):
        out.append(
            f"no --model given: {cfg['model']} assumed for KV bytes and step times; pass --model"
        )
    return out
