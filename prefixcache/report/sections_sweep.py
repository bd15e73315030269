"""Report sections for sweeps (capacity, block size, policy) and the consistency checks."""

from __future__ import annotations

from typing import Any

from prefixcache.report import fmt
from prefixcache.report.checks import consistency_checks
from prefixcache.report.model import Field, Section, Table
from prefixcache.report.run import Run
from prefixcache.report.sweep import (
    VARIANT_KEYS,
    capacity_knees,
    extra_keys,
    sort_key,
    varying,
)

KNEE_MARK = "◀ knee"


def _cell(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return fmt.NA if value is None else str(value)
    if isinstance(value, (int, float)) and ("rate" in key or "ratio" in key):
        return fmt.pct(value)
    if isinstance(value, int):
        return fmt.count(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def sweep(run: Run) -> Section:
    section = Section("sweep", "Sweeps: hit rate against capacity, block size and policy")
    points = run.report["sweep"]
    if not points:
        section.notes.append("This run has no sweep.")
        return section
    variants = [k for k in VARIANT_KEYS if any(k in p for p in points)]
    extras = extra_keys(points)
    bytes_per_block = run.report["config"]["bytes_per_block"]
    with_bytes = bytes_per_block is not None and not varying(points, "block_size")
    knees = capacity_knees(points)
    knee_ids = {id(p) for p in knees.values()}
    columns = [
        "Capacity (blocks)",
        *(["Capacity"] if with_bytes else []),
        *(k.replace("_", " ").capitalize() for k in variants),
        "Token hit rate",
        "Block hit rate",
        "Evicted blocks",
        *(k.replace("_", " ").capitalize() for k in extras),
        "Knee",
    ]
    ordered = sorted(
        points, key=lambda p: ([sort_key(p.get(k)) for k in variants], p["capacity_blocks"])
    )
    rows = [
        [
            fmt.count(p["capacity_blocks"]),
            *([fmt.nbytes(p["capacity_blocks"] * bytes_per_block)] if with_bytes else []),
            *(_cell(k, p.get(k)) for k in variants),
            fmt.pct(p["token_hit_rate"]),
            fmt.pct(p["block_hit_rate"]),
            fmt.count(p["evicted_blocks"]),
            *(_cell(k, p.get(k)) for k in extras),
            KNEE_MARK if id(p) in knee_ids else "",
        ]
        for p in ordered
    ]
    section.tables.append(Table(columns, rows, key="miss_ratio_curve"))
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
    section.plots += [f"sweep_{k}" for k in VARIANT_KEYS if varying(points, k)]
    return section


def consistency(run: Run) -> Section:
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
