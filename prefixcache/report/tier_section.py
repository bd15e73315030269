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
    """Hit tokens per tier (GPU, host, pool, computed) and the cost of the loads."""
    t = report["tiers"]
    prompt = report["prompt_tokens"]
    rows = []
    for label, key in (
        ("GPU", "gpu_hit_tokens"),
        ("Host", "host_hit_tokens"),
        ("Pool", "pool_hit_tokens"),
        ("Computed", "computed_tokens"),
    ):
        rows.append([label, fmt.count(t[key]), fmt.pct(t[key] / prompt if prompt else None)])
    host, pool = t["host"], t["pool"]
    fields = [
        Field(
            "Host tier",
            f"{fmt.nbytes(host['bytes'])} ({fmt.count(host['blocks'])} blocks) per replica at "
            f"{host['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
        ),
        Field(
            "Pool",
            f"{fmt.nbytes(pool['bytes'])} ({fmt.count(pool['blocks'])} blocks) shared at "
            f"{pool['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"{_WRITES.get(pool.get('write'), _WRITES['evict'])}",
        ),
        Field("Blocks loaded from host", fmt.count(host["loaded_blocks"])),
        Field("Blocks loaded from the pool", fmt.count(pool["loaded_blocks"])),
        *(
            [Field("Blocks written to the pool", fmt.count(pool["written_blocks"]))]
            if "written_blocks" in pool
            else []
        ),
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
