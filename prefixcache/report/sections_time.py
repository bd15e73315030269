"""Report sections over time: block states, evictions, rolling hit rate, serving latency."""

from __future__ import annotations

import numpy as np

from prefixcache.report import fmt
from prefixcache.report.figures import PERCENTILES, timeline_in_seconds, timeline_summary
from prefixcache.report.model import Field, Section, Table, TextChart
from prefixcache.report.run import Run
from prefixcache.report.textcharts import sparkline


def over_time(run: Run) -> Section:
    section = Section("time", "Over time")
    summary = timeline_summary(run)
    if summary is None:
        section.notes.append("The timeline is empty.")
        return section
    s = summary
    seconds = timeline_in_seconds(run)

    def at(t: float) -> str:
        return fmt.seconds(t) if seconds else f"request {fmt.count(t)}"

    def length(t: float | None) -> str:
        return fmt.seconds(t) if seconds or t is None else f"{fmt.count(t)} requests"

    section.fields += [
        Field("Timeline", f"{at(s.start)} to {at(s.end)}"),
        Field(
            "Active blocks (peak / end)",
            f"{fmt.count(s.peak_active)} / {fmt.count(s.final_active)}",
            "block_states",
        ),
        Field(
            "Cached blocks (peak / end)",
            f"{fmt.count(s.peak_cached)} / {fmt.count(s.final_cached)}",
            "block_states",
        ),
        Field(
            "Free blocks (lowest / end)",
            f"{fmt.count(s.min_free)} / {fmt.count(s.final_free)}",
            "block_states",
        ),
        Field("Evicted blocks", fmt.count(s.evicted), "evicted_blocks"),
        Field(
            "Rolling hit rate (start → end)",
            f"{fmt.pct(s.rolling_first)} → {fmt.pct(s.rolling_final)}",
            "rolling_hit_rate",
        ),
        Field("Warm-up", length(s.warm_up), "warm_up"),
    ]
    tl = run.timeline
    capacity = run.report["config"]["capacity_blocks"]
    section.charts.append(
        TextChart(
            "Over time (left to right)",
            [
                f"rolling hit rate │{sparkline(tl['rolling_token_hit_rate'])}│ 0–100%",
                f"cached blocks    │{sparkline(tl['blocks_cached'], hi=capacity)}│ 0–{capacity}",
                f"active blocks    │{sparkline(tl['blocks_active'], hi=capacity)}│ 0–{capacity}",
            ],
        )
    )
    section.plots.append("timeline")
    return section


def serving(run: Run) -> Section:
    section = Section("serving", "Serving: time to first token (estimate)")
    sv = run.report["serving"]
    if sv is None:
        section.notes.append(
            f"Mode '{run.report['config']['mode']}' simulates no serving "
            "timing; time to first token is estimated in serving mode only."
        )
        return section
    rows = []
    for q in PERCENTILES:
        cached, nocache = sv[f"ttft_p{q}_s"], sv[f"ttft_nocache_p{q}_s"]
        speedup = nocache / cached if cached > 0 else None
        rows.append([f"p{q}", fmt.seconds(cached), fmt.seconds(nocache), fmt.ratio(speedup)])
    section.tables.append(
        Table(
            ["TTFT", "With cache", "No cache", "Speed-up"],
            rows,
            key="ttft",
            caption="Estimated by the replay's cost model",
        )
    )
    section.fields += [
        Field("Preemptions", fmt.count(sv["preemptions"]), "preemptions"),
        Field("Scheduler steps", fmt.count(sv["steps"])),
        Field("Simulated time", fmt.seconds(sv["simulated_seconds"])),
    ]
    if np.isfinite(run.requests["ttft_s"].astype(np.float64)).any():
        section.plots.append("ttft")
    return section
