"""The report section of a replay with memory tiers: hit tokens by tier and the transfers."""

from __future__ import annotations

from typing import Any

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Field, Section, Table

# how blocks enter the pool, per write policy (reports without one wrote at eviction)
_WRITES = {
    "evict": "written when a replica evicts them",
    "through": "written through as computed",
}


def tiers_section(report: dict[str, Any]) -> Section:
    """Hit tokens per tier (GPU, host, shared pool, computed) and the cost of the loads; a tier
    the run was not given (no blocks, no hits) is left out."""
    t = report["tiers"]
    prompt = report["prompt_tokens"]
    host, pool = t["host"], t["pool"]
    has_host = bool(host["blocks"] or t["host_hit_tokens"])
    has_pool = bool(pool["blocks"] or t["pool_hit_tokens"])
    rows = []
    for label, key, shown in (
        ("GPU", "gpu_hit_tokens", True),
        ("Host tier", "host_hit_tokens", has_host),
        ("Shared pool", "pool_hit_tokens", has_pool),
        ("Computed", "computed_tokens", True),
    ):
        if shown:
            rows.append([label, fmt.count(t[key]), fmt.pct(t[key] / prompt if prompt else None)])
    fields: list[Field] = []
    if has_host:
        fields.append(
            Field(
                "Host tier",
                f"{fmt.nbytes(host['bytes'])} ({fmt.count(host['blocks'])} blocks) per replica "
                f"at {host['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
            )
        )
    if has_pool:
        fields.append(
            Field(
                "Shared pool",
                f"{fmt.nbytes(pool['bytes'])} ({fmt.count(pool['blocks'])} blocks) shared at "
                f"{pool['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
                f"{_WRITES.get(pool.get('write'), _WRITES['evict'])}",
            )
        )
    if has_host:
        fields.append(Field("Blocks loaded from the host tier", fmt.count(host["loaded_blocks"])))
    if has_pool:
        fields.append(Field("Blocks loaded from the shared pool", fmt.count(pool["loaded_blocks"])))
        if "written_blocks" in pool:
            fields.append(
                Field("Blocks written to the shared pool", fmt.count(pool["written_blocks"]))
            )
    fields += [
        Field("Transfer time", fmt.seconds(t["transfer_seconds"]), "tier_transfer"),
        Field(
            "Prefill time saved net of transfers",
            fmt.seconds(t["net_prefill_seconds_saved"]),
            "tier_net_saved",
            "estimate",
        ),
    ]
    table = Table(["Tier", "Tokens", "Share of prompt tokens"], rows, key="tier_hits")
    return Section("tiers", "Memory tiers", fields=fields, tables=[table])
