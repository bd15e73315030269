"""The serving sections of a run's report: throughput and latency with and without the cache
(the benchmark figures or the TTFT table), the offered load, the cost model's assumptions, and
the fleet of replicas behind the router.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Field, Section, Table
from prefixcache.report.run_dir import Run
from prefixcache.run_format import PERCENTILES


def serving(run: Run) -> Section:
    """Throughput and latency with and without the cache, the offered load and the cost
    model's assumptions; a note instead in a mode that simulates no timing."""
    section = Section("serving", "Serving: throughput and latency (estimate)")
    sv = run.report["serving"]
    if sv is None:
        section.notes.append(
            f"Mode '{run.report['config']['mode']}' simulates no serving "
            "timing; time to first token is estimated in serving mode only."
        )
        return section
    bench = sv.get("benchmark")
    if bench:
        section.tables.append(benchmark_table(bench["with_cache"], bench["without_cache"]))
    else:
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
    load = sv.get("load")
    if load:
        section.fields += load_fields(load, sv.get("ttft_p50_s"), sv.get("ttft_p99_s"))
    section.fields += [
        Field("Preemptions", fmt.count(sv["preemptions"]), "preemptions"),
        Field("Scheduler steps", fmt.count(sv["steps"])),
        Field(
            "Simulated time (first arrival to last finish)", fmt.seconds(sv["simulated_seconds"])
        ),
    ]
    section.fields += assumption_fields(run.report["config"], sv.get("assumptions"))
    section.fields += continuation_fields(run.report)
    if np.isfinite(run.requests["ttft_s"].astype(np.float64)).any():
        section.plots.append("ttft")
    return section


def _ms(x: float) -> str:
    return f"{1000 * x:,.1f} ms" if x < 10 else fmt.seconds(x)


def no_tpot(figures: dict[str, Any]) -> bool:
    """Whether no request had a second output token, so there is no time per output token:
    the replay writes 0.0 for a TPOT over no request (a measured one is always above 0)."""
    return not figures["tpot_mean_s"]


def same_load(load: dict[str, Any]) -> bool:
    """Whether the offered load reads the same with and without the cache."""
    return f"{load['offered_load']:.2f}" == f"{load['offered_load_nocache']:.2f}"


def benchmark_table(cached: dict[str, Any], nocache: dict[str, Any]) -> Table:
    """The figures a vLLM / SGLang serving benchmark prints, with and without the cache."""
    rows: list[list[str]] = []

    def row(label: str, key: str, show: Any, higher_is_better: bool) -> None:
        a, b = cached[key], nocache[key]
        if key.startswith("tpot_") and no_tpot(cached) and no_tpot(nocache):
            rows.append([label, fmt.NA, fmt.NA, fmt.NA])  # every output is one token
            return
        if higher_is_better:
            change = a / b if b else None
        else:
            change = b / a if a else None
        rows.append([label, show(a), show(b), fmt.ratio(change)])

    row("Completed requests", "completed", fmt.count, True)
    row("Duration", "duration_s", fmt.seconds, False)
    row("Request throughput (req/s)", "request_throughput_rps", lambda x: f"{x:,.2f}", True)
    row("Output token throughput (tok/s)", "output_token_throughput_tps", fmt.count_f, True)
    row("Total token throughput (tok/s)", "total_token_throughput_tps", fmt.count_f, True)
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency")):
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{label} {stat}", f"{name}_{stat}_s", _ms, False)
    caption = "Simulated by the replay's cost model; its assumptions are listed in this section"
    if no_tpot(cached) and no_tpot(nocache):
        caption += ". TPOT: n/a, no request has more than one output token"
    return Table(["Figure", "With cache", "No cache", "Better by"], rows, caption, "benchmark")


NEAR_CAPACITY = 0.9  # the busiest GPU busy this share of the span: bursts queue
QUEUEING_TAIL = 10.0  # TTFT p99 over p50 past this (and over a second): requests wait in queues


def load_fields(
    load: dict[str, Any], ttft_p50: float | None = None, ttft_p99: float | None = None
) -> list[Field]:
    """Offered load: the GPUs' busy time against the span of the arrivals, and a verdict that
    reads the busiest replica and the TTFT tail, not the average alone."""
    offered = load["offered_load"]
    replicas = load.get("replicas", 1)
    if offered is None:
        value, note = fmt.NA, "all requests arrive at once"
    else:
        nocache = (
            "the same without the cache"
            if same_load(load)
            else f"no cache {load['offered_load_nocache']:.2f}x"
        )
        value = f"{offered:.2f}x ({nocache})"
        if replicas > 1:
            nocache += "" if same_load(load) else " per replica"
            value = (
                f"{offered:.2f}x per replica, busiest {load['offered_load_busiest']:.2f}x "
                f"({nocache})"
            )
        binding = load.get("offered_load_busiest") or offered
        queueing = (
            ttft_p50 is not None
            and ttft_p99 is not None
            and ttft_p99 > 1.0
            and ttft_p99 > QUEUEING_TAIL * ttft_p50
        )
        if load["overloaded"]:
            note = "OVERLOADED: queue grows without bound"
        elif binding > 1:
            note = "busy past the last arrival, but no queue grew"
        elif binding >= NEAR_CAPACITY or queueing:
            busiest = "the busiest GPU" if replicas > 1 else "the GPU"
            note = f"at capacity: {busiest} is busy {binding:.0%} of the span"
            if queueing:
                note += f"; TTFT p99 {ttft_p99:.3g} s against p50 {ttft_p50:.3g} s: requests queue"
        else:
            note = "sustainable"
    busy = f"GPU busy, {replicas} replicas" if replicas > 1 else "GPU busy"
    out = [
        Field("Offered load", value, "offered_load", note),
        Field(
            f"{busy} / arrival span",
            f"{fmt.seconds(load['busy_s'])} / {fmt.seconds(load['arrival_span_s'])}",
            "offered_load",
        ),
    ]
    scale = load.get("sustainable_rate_scale_estimate")
    if scale:
        out.append(Field("Rate scale at full load", f"{scale:.3g}", "offered_load", "estimate"))
    return out


def continuation_fields(report: dict[str, Any]) -> list[Field]:
    """Whether a Mooncake trace's turns were linked (none for other workloads)."""
    if report["source"]["kind"] != "mooncake":
        return []
    return [
        Field(
            "Multi-turn continuations",
            "on: later turns can hit the blocks earlier turns decoded"
            if report["config"].get("continuations")
            else "off: every block is synthesized from its hash id",
            "continuations",
        )
    ]


def assumption_fields(cfg: dict[str, Any], assumptions: dict[str, Any] | None) -> list[Field]:
    """The serving model's assumptions: GPU, parallelism, scheduler limits, efficiencies."""
    model = fmt.model_name(cfg["model"])
    if cfg.get("model_defaulted"):
        model += " (default: no --model given)"
    out = [Field("Model", model)]
    if assumptions:
        tp = assumptions["tp"]
        memory = assumptions.get("gpu_memory_bytes")
        gpu = f"{tp} x {assumptions['gpu']}" if tp > 1 else assumptions["gpu"]
        if memory:
            gpu += f" ({fmt.nbytes(memory)} each)"
        out += [
            Field("GPU", gpu, "roofline"),
            Field("Peak compute per GPU", fmt.flops(assumptions["peak_flops_per_gpu"]) + "/s"),
            Field(
                "HBM bandwidth per GPU", fmt.nbytes(assumptions["hbm_bytes_per_s_per_gpu"]) + "/s"
            ),
            Field("Compute efficiency (MFU)", fmt.pct(assumptions["compute_efficiency"])),
            Field("Bandwidth efficiency", fmt.pct(assumptions["memory_efficiency"])),
            Field("Step overhead", _ms(assumptions["step_overhead_s"])),
        ]
        for key, label in (
            ("attention_efficiency", "Attention efficiency (new tokens)"),
            ("context_attention_efficiency", "Attention efficiency (cached K/V)"),
        ):
            if assumptions.get(key) is not None:
                out.append(Field(label, fmt.pct(assumptions[key])))
        if cfg.get("gpu_profile"):
            out.append(Field("GPU profile", str(cfg["gpu_profile"]), note="calibrated"))
    elif cfg.get("gpu"):
        out.append(Field("GPU", str(cfg["gpu"]), "roofline"))
    if cfg.get("token_budget") is not None:
        out += [
            Field("Token budget per step", fmt.count(cfg["token_budget"])),
            Field("Max running sequences", fmt.count(cfg["max_seqs"])),
        ]
    if cfg.get("rate_scale") is not None:
        out.append(
            Field("Arrival scaling", f"rate x{cfg['rate_scale']:g}, time x{cfg['time_scale']:g}")
        )
    return out


def fleet(run: Run) -> Section:
    """Replicas behind the router: per-replica load, hit rate and TTFT, and the pooled line."""
    fl = run.report["fleet"]
    section = Section("fleet", f"Fleet: {fl['replicas']} replicas routed by {fl['routing']}")
    rows = [
        [
            r["name"],
            fmt.count(r["requests"]),
            fmt.seconds(r["busy_seconds"]),
            fmt.pct(r["token_hit_rate"]),
            fmt.seconds(r["ttft_p50_s"]),
            fmt.seconds(r["ttft_p99_s"]),
            fmt.count(r["evicted_blocks"]),
        ]
        for r in fl["per_replica"]
    ]
    pooled = fl["pooled"]
    if pooled is not None:
        rows.append(
            [
                f"pooled ({fmt.capacity(pooled['capacity_blocks'])} blocks)",
                fmt.count(run.report["requests"]),
                fmt.NA,
                fmt.pct(pooled["token_hit_rate"]),
                fmt.seconds(pooled["ttft_p50_s"]),
                fmt.seconds(pooled["ttft_p99_s"]),
                fmt.NA,
            ]
        )
    section.tables.append(
        Table(
            ["Replica", "Requests", "Busy", "Token hit rate", "TTFT p50", "TTFT p99", "Evicted"],
            rows,
            caption=pooled_caption(run.report["config"].get("tiers")),
        )
    )
    section.fields += [
        Field("Token hit rate (fleet)", fmt.pct(run.report["token_hit_rate"])),
        Field(
            "Routing misses",
            fmt.pct(run.report["misses"]["routing"] / (run.report["prompt_tokens"] or 1)),
            note="of prompt tokens",
        ),
        *_attribution_fields(fl.get("attribution")),
        Field("Load imbalance", f"{fl['load_imbalance']:.2f}", note="max / mean busy time"),
        Field("Request imbalance", f"{fl['request_imbalance']:.2f}", note="max / mean"),
        Field(
            "Route rules",
            ", ".join(f"{k} {fmt.count(v)}" for k, v in fl["route_rules"].items()) or fmt.NA,
        ),
    ]
    return section


def _attribution_fields(a: dict[str, Any] | None) -> list[Field]:
    """Available, captured and delivered prompt tokens, as the service attributes them."""
    if not a:
        return []
    prompt = a["prompt_tokens"] or 1
    cells = ", ".join(
        f"{name} {fmt.pct(a[f'{name}_tokens'] / prompt)}"
        for name in ("available", "captured", "delivered")
    )
    return [
        Field(
            "Reuse available, captured, delivered",
            cells,
            note="of prompt tokens: the best any replica held, the chosen one's, the engine's "
            "(a replay's engine delivers what its cache holds: delivered equals captured by "
            "construction)",
        )
    ]


def pooled_caption(tiers: dict[str, Any] | None) -> str:
    """What the pooled line is: one replica of the fleet's size, and the same shared pool when
    there is one (so it moves with the pool's write policy too)."""
    text = "Pooled: one replica with N x the blocks and N x the compute"
    if tiers and tiers.get("host_blocks"):
        text += ", N x the host tier"
    if tiers and tiers.get("pool_blocks"):
        written = "as computed" if tiers.get("pool_write") == "through" else "on eviction"
        text += f", and the same shared pool (written {written})"
    return text
