"""Per-tenant figures of a replay: hit rate, misses by cause, evictions, and the noisy neighbour.

A tenant is a cache salt (``Namespace.salt``; requests without one are the tenant ``None``).
Hits and misses come from the replay's per-request rows, summed per tenant; evictions and the
neighbour's part come from the managers' tenant counters (summed over a fleet's replicas):
``noisy_neighbour_tokens`` are the prompt tokens a tenant computed again because another
tenant's allocation had evicted them, a part of its capacity misses.

With shares, the runner replays the workload a second time without them (the same cache, the
tenants counted) and ``without_shares`` puts the two side by side, so a planner sees what a
guarantee buys its tenant and what it costs the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.tenant_shares import TenantShare, TenantStats
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.run_format import MISS_CAUSES


def tenants_report(
    acc: Accountant,
    managers: Sequence[CacheManager],
    shares: Mapping[str, TenantShare] | None,
) -> dict[str, Any]:
    """The ``tenants`` section of report.json: the shares in blocks and one row per tenant."""
    p = acc.block_size
    rows = _request_sums(acc)
    counters = _tenant_counters(managers)
    out_rows = []
    for tenant in sorted(set(rows) | set(counters), key=_order):
        sums = rows.get(tenant, {})
        prompt = int(sums.get("prompt_tokens", 0))
        hit = int(sums.get("hit_tokens", 0))
        c = counters.get(tenant)
        share = (shares or {}).get(tenant) if tenant is not None else None
        out_rows.append(
            {
                "tenant": tenant,
                "requests": int(sums.get("requests", 0)),
                "prompt_tokens": prompt,
                "hit_tokens": hit,
                "token_hit_rate": hit / prompt if prompt else None,
                "misses": {cause: int(sums.get(cause, 0)) for cause in MISS_CAUSES},
                "guaranteed_blocks": share.guaranteed if share is not None else 0,
                "cap_blocks": share.cap if share is not None else None,
                "cached_blocks": c.cached_blocks if c is not None else 0,
                "evicted_blocks": c.evicted_blocks if c is not None else 0,
                "evicted_by_others_blocks": c.evicted_by_others if c is not None else 0,
                "noisy_neighbour_tokens": c.recomputed_after_others * p if c is not None else 0,
                "cap_evicted_blocks": c.cap_evictions if c is not None else 0,
                "guarantee_break_blocks": c.guarantee_breaks if c is not None else 0,
            }
        )
    return {
        "shares": {
            t: {"guaranteed_blocks": s.guaranteed, "cap_blocks": s.cap}
            for t, s in (shares or {}).items()
        },
        "rows": out_rows,
    }


def with_comparison(report: dict[str, Any], without: dict[str, Any]) -> dict[str, Any]:
    """``report`` with each tenant's hit rate and neighbour figures from the replay without
    shares (``without``, a ``tenants_report`` of it) under ``without_shares``."""
    other = {row["tenant"]: row for row in without["rows"]}
    for row in report["rows"]:
        twin = other.get(row["tenant"])
        if twin is not None:
            row["without_shares"] = {
                "token_hit_rate": twin["token_hit_rate"],
                "hit_tokens": twin["hit_tokens"],
                "evicted_by_others_blocks": twin["evicted_by_others_blocks"],
                "noisy_neighbour_tokens": twin["noisy_neighbour_tokens"],
            }
    report["compared_without_shares"] = True
    return report


def _order(tenant: str | None) -> tuple[bool, str]:
    return tenant is not None, tenant or ""


def _request_sums(acc: Accountant) -> dict[str | None, dict[str, float]]:
    """Requests, prompt and hit tokens and misses by cause, per tenant (none without rows)."""
    log = acc.log
    if log is None or not len(log):
        return {}
    tenant_of = {i: ns.salt for ns, i in acc.namespaces.items()}
    columns = {
        "prompt_tokens": "prompt_tokens",
        "hit_tokens": "hit_tokens",
        "cold": "miss_cold",
        "capacity": "miss_capacity",
        "isolation": "miss_isolation",
        "tail": "miss_tail",
        "routing": "miss_routing",
    }
    ns = log.column("namespace")
    values = {key: log.column(col) for key, col in columns.items()}
    out: dict[str | None, dict[str, float]] = {}
    for i in np.unique(ns).tolist():
        mask = ns == i
        sums = out.setdefault(tenant_of[int(i)], {"requests": 0})
        sums["requests"] += int(mask.sum())
        for key, column in values.items():
            sums[key] = sums.get(key, 0) + int(column[mask].sum())
    return out


def _tenant_counters(managers: Sequence[CacheManager]) -> dict[str | None, TenantStats]:
    """The managers' tenant counters, summed field by field (a fleet's replicas)."""
    out: dict[str | None, TenantStats] = {}
    for mgr in managers:
        for tenant, row in mgr.tenant_stats().items():
            have = out.get(tenant)
            if have is None:
                out[tenant] = row
                continue
            out[tenant] = have._replace(
                cached_blocks=have.cached_blocks + row.cached_blocks,
                evicted_blocks=have.evicted_blocks + row.evicted_blocks,
                evicted_by_others=have.evicted_by_others + row.evicted_by_others,
                recomputed_after_others=have.recomputed_after_others + row.recomputed_after_others,
                cap_evictions=have.cap_evictions + row.cap_evictions,
                guarantee_breaks=have.guarantee_breaks + row.guarantee_breaks,
            )
    return out
