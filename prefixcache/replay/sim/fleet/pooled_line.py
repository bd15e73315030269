"""The pooled line of a fleet replay: one replica with N x the blocks and N x the compute.

Token budget, running sequences, peak FLOPs and memory bandwidth are all scaled by N (and, with
tiers, the host memory and every link, with the same shared pool). With every block in one cache
and no route to get wrong, its hit rate is what routing aims for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import NamedTuple

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.serving import Simulator
from prefixcache.replay.tiers.admission import build_tiers
from prefixcache.replay.workload.request import Request
from prefixcache.run_format import nearest_rank, rate


class PooledLine(NamedTuple):
    """One replica with N x the blocks and N x the compute, replaying the same requests."""

    capacity_blocks: int
    token_hit_rate: float
    block_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float


def served_percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (nearest rank) of the served requests' ``values`` (NaN: not
    served), 0.0 with none."""
    served = [v for v in values if not math.isnan(v)]
    return nearest_rank(served, q) if served else 0.0


def pooled_config(cfg: ResolvedConfig) -> ResolvedConfig:
    """One replica with N x the blocks, token budget, running sequences, FLOPs and bandwidth;
    with tiers, N x the host memory and N x every link (the same shared pool)."""
    o = cfg.options
    n = o.replicas
    gpu = cfg.gpu
    if gpu is not None:
        gpu = replace(gpu, peak_flops=gpu.peak_flops * n, hbm_bytes_per_s=gpu.hbm_bytes_per_s * n)
    blocks = min(cfg.capacity_blocks * n, UNBOUNDED)  # n unbounded caches pool to one
    tiers = cfg.tiers
    if tiers is not None:
        host_bw, pool_bw = tiers.host_bandwidth * n, tiers.pool_bandwidth * n
        host, pool = tiers.host_transfer, tiers.pool_transfer
        tiers = replace(
            tiers,
            host_blocks=tiers.host_blocks * n,
            host_bytes=tiers.host_bytes * n,
            host_bandwidth=host_bw,
            pool_bandwidth=pool_bw,
            recompute_seconds_per_token=tiers.recompute_seconds_per_token / n,
            host_transfer=host._replace(host_bandwidth=host_bw, flops=host.flops * n),
            pool_transfer=pool._replace(host_bandwidth=pool_bw, flops=pool.flops * n),
        )
    return replace(
        cfg,
        options=o.with_(
            replicas=1,
            routing=None,
            record=False,
            capacity_blocks=blocks,
            kv_memory=None,
            token_budget=o.token_budget * n,
            max_seqs=o.max_seqs * n,
        ),
        capacity_blocks=blocks,
        capacity_bytes=cfg.capacity_bytes * n if cfg.capacity_bytes is not None else None,
        gpu=gpu,
        tiers=tiers,
    )


def run_pooled(
    requests: Iterable[Request],
    cfg: ResolvedConfig,
    on_finish: Callable[[int], None] | None = None,
) -> PooledLine:
    """Replay ``requests`` through the pooled cache of ``pooled_config(cfg)``; ``on_finish`` is
    told how many requests each step completed."""
    pooled = pooled_config(cfg)
    mgr = pooled.cache_manager()
    acc = Accountant(pooled.options.block_size, mgr.hasher, track_isolation=False, record=False)
    sim = Simulator(mgr, pooled, acc)
    sim.on_finish = on_finish
    tiers = build_tiers(pooled, [mgr])
    sim.tiers = tiers.admitters[0] if tiers is not None else None
    sim.run(requests)
    tot = acc.totals
    return PooledLine(
        pooled.capacity_blocks,
        rate(tot.hit_tokens, tot.prompt_tokens),
        rate(tot.hit_blocks, tot.prompt_blocks),
        served_percentile(sim.times.ttft, 50),
        served_percentile(sim.times.ttft, 99),
    )
