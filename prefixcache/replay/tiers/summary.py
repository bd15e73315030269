"""The ``tiers`` part of report.json: hits split by tier, what moved over each link, and the
prefill time the tiers saved net of their transfers."""

from __future__ import annotations

from typing import Any

from prefixcache.manager.stats import CacheStats
from prefixcache.replay.sim.accounting import Totals
from prefixcache.replay.tiers.admission import Tiers
from prefixcache.run_format import rate


def tiers_report(tiers: Tiers, totals: Totals, stats: CacheStats) -> dict[str, Any]:
    """Prompt tokens by where their K/V came from (GPU, host, pool, computed), per-tier
    traffic, and the prefill seconds saved by every hit less the seconds spent loading.

    Writes into the pool (``written_blocks``, every block sent, refreshes included) are link
    traffic too, reported with their link time (``write_seconds``) but not added to
    ``transfer_seconds``: they leave the GPU in the other direction of the link, after the
    blocks are computed, and delay no prefill."""
    settings, pool, admitters = tiers.settings, tiers.pool, tiers.admitters
    prompt = totals.prompt_tokens
    host = totals.host_hit_tokens
    pooled = totals.pool_hit_tokens
    gpu = totals.hit_tokens - host - pooled
    computed = prompt - totals.hit_tokens
    host_loaded = stats.loaded_blocks
    pool_loaded = sum(a.pool_loaded_blocks for a in admitters)
    transfer_s = settings.load_seconds(host_loaded, pool_loaded)
    written = pool.written_blocks if pool is not None else 0
    saved_s = totals.hit_tokens * settings.recompute_seconds_per_token
    return {
        "gpu_hit_tokens": gpu,
        "host_hit_tokens": host,
        "pool_hit_tokens": pooled,
        "computed_tokens": computed,
        "gpu_token_hit_rate": rate(gpu, prompt),
        "host_token_hit_rate": rate(host, prompt),
        "pool_token_hit_rate": rate(pooled, prompt),
        "host": {
            "blocks": settings.host_blocks,
            "bytes": settings.host_bytes,
            "bandwidth_bytes_per_s": settings.host_bandwidth,
            "found_blocks": stats.host_hit_blocks,
            "loaded_blocks": host_loaded,
            "offloaded_blocks": stats.offloaded_blocks,
            "evicted_blocks": stats.host_evicted_blocks,
        },
        "pool": {
            "blocks": settings.pool_blocks,
            "bytes": settings.pool_bytes,
            "bandwidth_bytes_per_s": settings.pool_bandwidth,
            "found_blocks": sum(a.pool_found_blocks for a in admitters),
            "loaded_blocks": pool_loaded,
            "stored_blocks": pool.stored_blocks if pool is not None else 0,
            "evicted_blocks": pool.evicted_blocks if pool is not None else 0,
            "write": settings.pool_write,
            "written_blocks": written,
            "write_seconds": written * settings.bytes_per_block / settings.pool_bandwidth,
        },
        "transfer_seconds": transfer_s,
        "prefill_seconds_saved": saved_s,
        "net_prefill_seconds_saved": saved_s - transfer_s,
    }


def tiers_row(tiers: dict[str, Any]) -> dict[str, Any]:
    """The tier columns of a sweep line."""
    return {
        "host_blocks": tiers["host"]["blocks"],
        "pool_blocks": tiers["pool"]["blocks"],
        "gpu_token_hit_rate": tiers["gpu_token_hit_rate"],
        "host_token_hit_rate": tiers["host_token_hit_rate"],
        "pool_token_hit_rate": tiers["pool_token_hit_rate"],
    }
