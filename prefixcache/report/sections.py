"""The report of one run as a format-neutral document: every section, built from the run.

The sections about the run as a whole (header, headline, requests, misses, savings, prefixes),
over time (block states, evictions, rolling hit rate), and for sweeps (capacity, block size,
policy) with the consistency checks; the serving and fleet sections are in ``serving_sections``,
the memory tiers' in ``tier_section``.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.report import formatting as fmt
from prefixcache.report.checks import consistency_checks
from prefixcache.report.document import Document, Field, Section, Table, TextChart
from prefixcache.report.figures import (
    achieved,
    hit_ratio_histogram,
    ratio_percentiles,
    request_hit_ratios,
    timeline_in_seconds,
    timeline_summary,
)
from prefixcache.report.formatting import bars, sparkline
from prefixcache.report.run_dir import Run
from prefixcache.report.run_warnings import run_warnings
from prefixcache.report.serving_sections import continuation_fields, fleet, serving
from prefixcache.report.sweep_curves import (
    VARIANT_KEYS,
    capacity_knees,
    extra_keys,
    miss_causes,
    miss_share,
    sort_key,
    sweep_label,
    varying,
)
from prefixcache.report.tenant_section import tenants_section
from prefixcache.report.tier_section import tiers_section
from prefixcache.run_format import MISS_CAUSES, PERCENTILES

MAX_NAMESPACES_SHOWN = 8
TOP_PREFIXES_SHOWN = 10
KNEE_MARK = "◀ knee"


def build_document(run: Run) -> Document:
    """The whole report of ``run``: its sections in reading order, with the run's warnings."""
    r = run.report
    fl = r.get("fleet")
    per_replica = " per replica" if fl else ""
    subtitle = (
        f"{Path(r['source']['path']).name}: {r['requests']:,} requests, block size "
        f"{r['config']['block_size']}, {fmt.capacity(r['config']['capacity_blocks'])} blocks"
        f"{per_replica}, {r['config']['policy']}, {r['config']['mode']}"
    )
    if fl:
        subtitle += f", {fmt.plural(fl['replicas'], 'replica')} routed by {fl['routing']}"
    tiers = r.get("tiers") or {}
    if (tiers.get("host") or {}).get("blocks"):
        subtitle += f", host tier {fmt.nbytes(tiers['host']['bytes'])}{per_replica}"
    if (tiers.get("pool") or {}).get("blocks"):
        subtitle += f", pool {fmt.nbytes(tiers['pool']['bytes'])} shared"
    return Document(
        title="prefixcache report",
        subtitle=subtitle,
        warnings=run_warnings(r),
        sections=[
            header(run),
            headline(run),
            requests(run),
            misses(run),
            *([tiers_section(r)] if r.get("tiers") else []),
            *([tenants_section(r)] if r.get("tenants") else []),
            savings(run),
            over_time(run),
            serving(run),
            *([fleet(run)] if run.report.get("fleet") else []),
            top_prefixes(run),
            sweep(run),
            consistency(run),
        ],
    )


# ---- the run as a whole -----------------------------------------------------------------------


def header(run: Run) -> Section:
    """What was replayed and how: workload, digests, cache size, policy, model, speed."""
    r, cfg = run.report, run.report["config"]
    ns = r["namespaces"]
    shown = ", ".join(ns[:MAX_NAMESPACES_SHOWN])
    more = f" (+{len(ns) - MAX_NAMESPACES_SHOWN} more)" if len(ns) > MAX_NAMESPACES_SHOWN else ""
    capacity = f"{fmt.capacity(cfg['capacity_blocks'])} blocks"
    if cfg["capacity_bytes"] is not None:
        capacity += f" ({fmt.nbytes(cfg['capacity_bytes'])})"
    if r.get("fleet"):
        capacity += f" per replica ({fmt.plural(r['fleet']['replicas'], 'replica')})"
    fields = [
        Field("Library version", r["library_version"]),
        Field("Workload", f"{r['source']['path']} ({r['source']['kind']})"),
        Field("Workload digest", r["source"]["sha256"], "trace_sha256"),
        Field("Config digest", r["config_sha256"], "config_sha256"),
        Field("Hash algorithm", cfg["hash_algo"]),
        Field("Namespaces", f"{len(ns)}: {shown}{more}" if ns else "0"),
        Field("Block size", f"{cfg['block_size']} tokens"),
        Field("Capacity", capacity, "capacity"),
        Field("Bytes per block", fmt.nbytes(cfg["bytes_per_block"])),
        Field("Policy", cfg["policy"]),
        Field("Mode", cfg["mode"]),
        Field("Seed", str(cfg["seed"])),
        Field("Model", fmt.model_name(cfg["model"]) if cfg["model"] is not None else fmt.NA),
        Field("Partial-block copy", "on" if cfg["partial_copy"] else "off"),
        *(continuation_fields(r) if cfg["mode"] != "serving" else []),  # else: assumptions
        Field(
            "Replay speed",
            f"{fmt.count(round(r['requests_per_second']))} requests/s "
            f"({fmt.count(r['requests'])} in {fmt.seconds(r['replay_seconds'])})",
            "replay_speed",
        ),
    ]
    note = (
        f"Data in {run.path}: report.json (schema version {r['schema_version']}), "
        "requests.csv (a row per request), timeline.csv (time series)."
    )
    return Section("run", "Run", fields=fields, notes=[note])


def headline(run: Run) -> Section:
    """Token and block hit rates against the infinite-cache upper bound."""
    r = run.report
    tok, tok_ub = r["token_hit_rate"], r["upper_bound_token_hit_rate"]
    blk, blk_ub = r["block_hit_rate"], r["upper_bound_block_hit_rate"]
    fields = [
        Field("Requests", fmt.count(r["requests"])),
        Field("Prompt tokens", fmt.count(r["prompt_tokens"])),
        Field("Hit tokens", fmt.count(r["hit_tokens"]), "hit_tokens"),
        Field("Token hit rate", fmt.pct(tok), "token_hit_rate"),
        Field("Token hit rate upper bound", fmt.pct(tok_ub), "upper_bound"),
        Field("Token hit rate achieved / upper bound", fmt.pct(achieved(tok, tok_ub)), "achieved"),
        Field("Prompt blocks", fmt.count(r["prompt_blocks"])),
        Field("Hit blocks", fmt.count(r["hit_blocks"])),
        Field("Block hit rate", fmt.pct(blk), "block_hit_rate"),
        Field("Block hit rate upper bound", fmt.pct(blk_ub), "upper_bound"),
        Field("Block hit rate achieved / upper bound", fmt.pct(achieved(blk, blk_ub)), "achieved"),
        Field("Output tokens", fmt.count(r["output_tokens"])),
    ]
    # optional counters, shown when the replay reports them
    for key, label in (
        ("rejected_requests", "Rejected requests"),
        ("truncated_outputs", "Truncated outputs"),
    ):
        if isinstance(r.get(key), int):
            fields.append(Field(label, fmt.count(r[key]), key))
    return Section("headline", "Hit rate", fields=fields, plots=["headline"])


def requests(run: Run) -> Section:
    """The spread of the per-request hit ratio: percentiles and a histogram."""
    ratios = request_hit_ratios(run)
    pcts = ratio_percentiles(ratios)
    zero = run.report["zero_hit_requests"]
    share = zero / run.report["requests"] if run.report["requests"] else None
    fields = [
        Field(f"Per-request hit ratio p{q}", fmt.pct(pcts[q]), "request_hit_ratio")
        for q in PERCENTILES
    ]
    fields.append(
        Field(
            "Requests with zero hits", f"{fmt.count(zero)} ({fmt.pct(share)})", "zero_hit_requests"
        )
    )
    hist = hit_ratio_histogram(ratios)
    labels = [f"{100 * lo:3.0f}–{100 * hi:3.0f}%" for lo, hi in pairwise(hist.edges)]
    chart = TextChart("Requests by hit ratio", bars(labels, list(hist.counts)))
    return Section(
        "requests",
        "Per-request hit ratio",
        fields=fields,
        charts=[chart],
        plots=["hit_ratio_histogram"],
    )


def misses(run: Run) -> Section:
    """Missed prompt tokens by cause."""
    r = run.report
    total = r["prompt_tokens"] - r["hit_tokens"]
    rows: list[list[str]] = []
    keys: list[str | None] = []
    for cause in MISS_CAUSES:
        n = r["misses"][cause]
        rows.append(
            [
                f"{cause.capitalize()} miss",
                fmt.count(n),
                fmt.pct(n / total if total else None),
                fmt.pct(n / r["prompt_tokens"] if r["prompt_tokens"] else None),
            ]
        )
        keys.append(f"miss_{cause}")
    rows.append(
        [
            "All misses",
            fmt.count(total),
            fmt.pct(1.0 if total else None),
            fmt.pct(total / r["prompt_tokens"] if r["prompt_tokens"] else None),
        ]
    )
    keys.append(None)
    table = Table(
        ["Cause", "Tokens", "Share of misses", "Share of prompt tokens"],
        rows,
        key="misses",
        row_keys=keys,
    )
    return Section("misses", "Where the misses come from", tables=[table], plots=["misses"])


def savings(run: Run) -> Section:
    """What the cache saved: prefill tokens, FLOPs, and KV memory by sharing blocks."""
    r, s = run.report, run.report["savings"]
    flops = s["flops_saved_estimate"]
    kv = s["kv_bytes_saved_by_sharing"]
    basis = s.get("estimate_basis")  # runs written before these figures have none
    no_model = "no model given (--model)"
    fields = [
        Field("Prefill tokens saved", fmt.count(s["prefill_tokens_saved"]), "prefill_tokens_saved"),
        Field(
            "FLOPs saved",
            fmt.flops(flops),
            "flops_saved",
            "estimate" if flops is not None else no_model,
        ),
        Field(
            "GPU time saved",
            gpu_seconds(s.get("gpu_seconds_saved_estimate")),
            "gpu_seconds_saved",
            "estimate" if basis else no_model,
        ),
        Field(
            "KV bytes not recomputed",
            fmt.nbytes(s.get("kv_bytes_not_recomputed")),
            "kv_bytes_not_recomputed",
            "" if basis else no_model,
        ),
        Field("Logical blocks (peak)", fmt.count(s["logical_blocks_peak"]), "logical_blocks"),
        Field("Physical blocks (peak)", fmt.count(s["physical_blocks_peak"]), "physical_blocks"),
        Field("Sharing factor", fmt.ratio(s["sharing_factor"]), "sharing_factor"),
        Field(
            "KV bytes saved by sharing",
            fmt.nbytes(kv),
            "kv_bytes_saved",
            "" if kv is not None else "bytes per block unknown",
        ),
        Field(
            "Internal fragmentation",
            f"{fmt.count(s['internal_fragmentation_slots'])} slots",
            "fragmentation",
        ),
        Field("Copy-on-write copies", fmt.count(r["cow_copies"]), "cow_copies"),
        Field(
            "Partially copied tokens", fmt.count(r["partial_copy_tokens"]), "partial_copy_tokens"
        ),
        Field("Evicted blocks", fmt.count(r["evicted_blocks"]), "evicted_blocks"),
        Field("Peak blocks in use", fmt.count(r["peak_blocks_in_use"]), "peak_blocks_in_use"),
    ]
    notes = [estimate_basis(basis)] if basis else []
    return Section("savings", "Savings", fields=fields, notes=notes)


def gpu_seconds(x: float | None) -> str:
    """GPU time: seconds, or hours past a few of them."""
    if x is None or x < 3 * 3600:
        return fmt.seconds(x)
    return f"{x / 3600:,.1f} GPU-hours"


def estimate_basis(basis: dict[str, Any]) -> str:
    """The assumptions behind the savings estimates, said once."""
    return (
        f"Estimates assume {basis['model']} ({fmt.nbytes(basis['kv_bytes_per_token'])} of KV "
        f"per token) and prefill on one {basis['gpu']} at "
        f"{basis['compute_efficiency']:.0%} of its {basis['peak_flops'] / 1e12:,.0f} TFLOP/s "
        "dense BF16 peak (--model, --gpu; a GPU profile from prefixcache calibrate sets the "
        "measured efficiency in serving mode)."
    )


def top_prefixes(run: Run) -> Section:
    """The shared prefixes that saved the most tokens."""
    prefixes = sorted(run.report["top_prefixes"], key=lambda p: -p["tokens_saved"])
    hits = run.report["hit_tokens"]
    rows = [
        [
            str(p["prefix_id"]),
            fmt.count(p["depth_blocks"]),
            fmt.count(p["requests"]),
            fmt.count(p["tokens_saved"]),
            fmt.pct(p["tokens_saved"] / hits if hits else None),
        ]
        for p in prefixes[:TOP_PREFIXES_SHOWN]
    ]
    section = Section("prefixes", "Top shared prefixes")
    if rows:
        section.tables.append(
            Table(
                ["Prefix id", "Depth (blocks)", "Requests", "Tokens saved", "Share of hit tokens"],
                rows,
                key="top_prefixes",
            )
        )
    else:
        section.notes.append("No prefix was shared.")
    return section


# ---- over time ---------------------------------------------------------------------------------


def over_time(run: Run) -> Section:
    """Block states, evictions and the rolling hit rate along the timeline."""
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
        *(
            [
                Field(
                    "Free blocks (lowest / end)",
                    f"{fmt.count(s.min_free)} / {fmt.count(s.final_free)}",
                    "block_states",
                )
            ]
            if run.report["config"]["capacity_blocks"] < UNBOUNDED  # else: all but the cached
            else []
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
    replicas = int(run.report["config"].get("replicas") or 1)
    if replicas > 1:
        bounded = capacity is not None and capacity < UNBOUNDED
        per = f" ({fmt.count(capacity)} blocks each)" if bounded else ""
        section.notes.append(
            f"A fleet: the blocks over time are the {replicas} replicas' together, against their "
            f"total capacity; the run's cache size is one replica's{per}."
        )
    if capacity is not None and capacity >= UNBOUNDED:  # scaled to what was used instead
        capacity = max(max(tl["blocks_cached"], default=0), max(tl["blocks_active"], default=0))
    elif capacity is not None:  # a fleet's timeline adds up its replicas, and its capacity too
        capacity *= int(run.report["config"].get("replicas") or 1)
    top = fmt.count(capacity) if capacity is not None else "max"
    section.charts.append(
        TextChart(
            "Over time (left to right)",
            [
                f"rolling hit rate │{sparkline(tl['rolling_token_hit_rate'])}│ 0–100%",
                f"cached blocks    │{sparkline(tl['blocks_cached'], hi=capacity)}│ 0–{top}",
                f"active blocks    │{sparkline(tl['blocks_active'], hi=capacity)}│ 0–{top}",
            ],
        )
    )
    section.plots.append("timeline")
    return section


# ---- sweeps and consistency --------------------------------------------------------------------


def _cell(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return fmt.NA if value is None else ("yes" if value else "no")
    if isinstance(value, (int, float)) and key.endswith("_s"):
        return fmt.seconds(value)
    if isinstance(value, (int, float)) and ("rate" in key or "ratio" in key):
        return fmt.pct(value)
    if isinstance(value, int):
        return fmt.count(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def sweep(run: Run) -> Section:
    """Hit rate at every sweep point, ordered by variant and capacity, with the knees."""
    section = Section("sweep", "Sweeps: hit rate against capacity, block size and policy")
    points = run.report["sweep"]
    if not points:
        section.notes.append("This run has no sweep.")
        return section
    variants = [k for k in VARIANT_KEYS if any(k in p for p in points)]
    extras = extra_keys(points)
    causes = miss_causes(points)
    bytes_per_block = run.report["config"]["bytes_per_block"]
    with_bytes = bytes_per_block is not None and not varying(points, "block_size")
    knees = capacity_knees(points)
    knee_ids = {id(p) for p in knees.values()}
    columns = [
        sweep_label("capacity_blocks"),
        *(["Capacity"] if with_bytes else []),
        *(sweep_label(k) for k in variants),
        "Token hit rate",
        "Block hit rate",
        "Evicted blocks",
        *(f"{c.capitalize()} miss" for c in causes),
        *(sweep_label(k) for k in extras),
        *(["Knee"] if knees else []),
    ]
    ordered = sorted(
        points, key=lambda p: ([sort_key(p.get(k)) for k in variants], p["capacity_blocks"])
    )
    rows = [
        [
            fmt.capacity(p["capacity_blocks"]),
            *(
                [
                    fmt.nbytes(p["capacity_blocks"] * bytes_per_block)
                    if p["capacity_blocks"] < UNBOUNDED
                    else fmt.NA
                ]
                if with_bytes
                else []
            ),
            *(_cell(k, p.get(k)) for k in variants),
            fmt.pct(p["token_hit_rate"]),
            fmt.pct(p["block_hit_rate"]),
            fmt.count(p["evicted_blocks"]),
            *(fmt.pct(miss_share(p, c)) for c in causes),
            *(_cell(k, p.get(k)) for k in extras),
            *([KNEE_MARK if id(p) in knee_ids else ""] if knees else []),
        ]
        for p in ordered
    ]
    caption = "Misses: share of the prompt tokens missed, by cause" if causes else ""
    section.tables.append(Table(columns, rows, key="miss_ratio_curve", caption=caption))
    for label, p in knees.items():
        where = f" ({label})" if label else ""
        section.fields.append(
            Field(
                f"Knee{where}",
                f"{fmt.count(p['capacity_blocks'])} blocks, "
                f"token hit rate {fmt.pct(p['token_hit_rate'])}",
                "knee",
            )
        )
    section.plots.append("sweep_capacity")
    section.plots += [f"sweep_{k}" for k in ("block_size", "policy") if varying(points, k)]
    return section


def consistency(run: Run) -> Section:
    """How many of the report's consistency checks pass, and the failed ones."""
    checks = consistency_checks(run)
    failed = [c for c in checks if not c.ok]
    section = Section(
        "consistency",
        "Consistency",
        fields=[
            Field(
                "Consistency checks",
                f"{len(checks) - len(failed)} of {len(checks)} pass",
                "consistency",
            )
        ],
    )
    if failed:
        section.tables.append(
            Table(["Failed check", "Detail"], [[c.name, c.detail] for c in failed])
        )
    return section
