"""The report section of a replay with tenants counted (``--shares``): per tenant, its hit rate,
misses, evictions and what its neighbours cost it, with and without the shares."""

from __future__ import annotations

from typing import Any

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Field, Section, Table


def _label(tenant: str | None) -> str:
    return "(no salt)" if tenant is None else tenant


def _share(row: dict[str, Any]) -> str:
    guaranteed, cap = row["guaranteed_blocks"], row["cap_blocks"]
    if not guaranteed and cap is None:
        return "-"
    text = f"{guaranteed:,} guaranteed" if guaranteed else "no guarantee"
    return text + (f", cap {cap:,}" if cap is not None else "")


def tenants_section(report: dict[str, Any]) -> Section:
    """One row per tenant; with shares, its hit rate and neighbour misses without them."""
    t = report["tenants"]
    compared = bool(t.get("compared_without_shares"))
    columns = ["Tenant", "Share (blocks)", "Requests", "Token hit rate"]
    if compared:
        columns.append("Without shares")
    columns += [
        "Capacity misses",
        "Of them, evicted by a neighbour",
        "Blocks evicted",
        "By a neighbour",
    ]
    if compared:
        columns.append("Neighbour misses without shares")
    rows = []
    for row in t["rows"]:
        cells = [
            _label(row["tenant"]),
            _share(row),
            fmt.count(row["requests"]),
            fmt.pct(row["token_hit_rate"]),
        ]
        twin = row.get("without_shares")
        if compared:
            cells.append(fmt.pct(twin["token_hit_rate"]) if twin else "-")
        cells += [
            fmt.count(row["misses"]["capacity"]),
            fmt.count(row["noisy_neighbour_tokens"]),
            fmt.count(row["evicted_blocks"]),
            fmt.count(row["evicted_by_others_blocks"]),
        ]
        if compared:
            cells.append(fmt.count(twin["noisy_neighbour_tokens"]) if twin else "-")
        rows.append(cells)
    breaks = sum(row["guarantee_break_blocks"] for row in t["rows"])
    capped = sum(row["cap_evicted_blocks"] for row in t["rows"])
    fields = [
        Field("Blocks evicted at a tenant's cap", fmt.count(capped)),
        Field("Blocks taken under a guarantee (nothing else was evictable)", fmt.count(breaks)),
    ]
    notes = [
        "A tenant is a cache salt. Misses are prompt tokens; a neighbour's misses are the "
        "capacity misses whose blocks another tenant's allocation had evicted. Shares are per "
        "replica, in GPU blocks."
    ]
    if compared:
        notes.append(
            "'Without shares' is the same workload replayed on the same cache with no share: "
            "what the guarantees bought their tenants, and what they cost the others."
        )
    table = Table(columns, rows, key="tenants")
    return Section("tenants", "Tenants", fields=fields, tables=[table], notes=notes)
