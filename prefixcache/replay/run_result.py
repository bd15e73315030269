"""The outcome of a replay, its canonical report (``report.json``) and the run directory.

A run directory holds report.json (canonical), requests.csv (a row per request) and timeline.csv.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prefixcache
from prefixcache.atomic_files import atomic_open, write_text_atomic
from prefixcache.errors import ConfigError
from prefixcache.manager.stats import CacheStats
from prefixcache.replay.model_specs import DEFAULT_COMPUTE_EFFICIENCY, ModelConfig, get_gpu
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.request_rows import format_number, write_requests_csv
from prefixcache.replay.sim.serving_figures import BenchmarkFigures, OfferedLoad
from prefixcache.replay.tiers.summary import tiers_row
from prefixcache.replay.workload.sources import continuations_of
from prefixcache.run_format import (
    MISS_CAUSES,
    PERCENTILES,
    SCHEMA_VERSION,
    TIMELINE_COLUMNS,
    nearest_rank,
    rate,
)


@dataclass
class ServingStats:
    ttft: list[float]  # seconds, per request (nan when never served)
    ttft_nocache: list[float]
    preemptions: int
    steps: int
    simulated_seconds: float  # from the first arrival to the last finish
    truncated: int = 0  # requests finished early: alone, they outgrew the cache
    with_cache: BenchmarkFigures | None = None  # benchmark figures (single-cache replays)
    without_cache: BenchmarkFigures | None = None
    load: OfferedLoad | None = None
    assumptions: dict[str, Any] | None = None  # the roofline's efficiencies and overhead

    def report_dict(self) -> dict[str, Any]:
        served = [t for t in self.ttft if not math.isnan(t)]
        unserved = [t for t in self.ttft_nocache if not math.isnan(t)]
        out: dict[str, Any] = {
            **{f"ttft_p{q}_s": _percentile(served, q) for q in PERCENTILES},
            **{f"ttft_nocache_p{q}_s": _percentile(unserved, q) for q in PERCENTILES},
            "preemptions": self.preemptions,
            "steps": self.steps,
            "simulated_seconds": self.simulated_seconds,
        }
        if self.with_cache is not None and self.without_cache is not None:
            out["benchmark"] = {
                "with_cache": self.with_cache.report_dict(),
                "without_cache": self.without_cache.report_dict(),
            }
        if self.load is not None:
            out["load"] = self.load.report_dict()
        if self.assumptions is not None:
            out["assumptions"] = self.assumptions
        return out


def _percentile(values: list[float], q: int) -> float:
    return nearest_rank(values, q) if values else 0.0


@dataclass
class ReplayResult:
    source: dict[str, Any]  # path, kind, sha256, name
    config: ResolvedConfig
    seed: int | None
    acc: Accountant
    stats: CacheStats  # the manager's own counters
    replay_seconds: float
    serving: ServingStats | None = None
    truncated_outputs: int = 0
    sweep: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.source.get("name", "run"))

    def config_dict(self) -> dict[str, Any]:
        out = self.config.report_dict(self.seed)
        if continuations_of(str(self.source.get("kind")), self.config.options):
            out["continuations"] = True  # absent: off (and the digest of older runs kept)
        return out

    def summary_row(self) -> dict[str, Any]:
        """One line of a sweep table."""
        tot = self.acc.totals
        return {
            "capacity_blocks": self.config.capacity_blocks,
            "block_size": self.config.options.block_size,
            "policy": self.config.options.policy,
            "token_hit_rate": rate(tot.hit_tokens, tot.prompt_tokens),
            "block_hit_rate": rate(tot.hit_blocks, tot.prompt_blocks),
            "upper_bound_token_hit_rate": self._bound(tot.ub_tokens, tot.prompt_tokens),
            "evicted_blocks": self.stats.evicted_blocks,
            "prompt_tokens": tot.prompt_tokens,
            "rejected_requests": tot.rejected,
            **(
                {"overloaded": self.serving.load.overloaded}
                if self.serving is not None and self.serving.load is not None
                else {}
            ),
            "misses": self._missed(),
            **self._fleet_row(),
            **(tiers_row(self.extra["tiers"]) if "tiers" in self.extra else {}),
        }

    def _missed(self) -> dict[str, int]:
        """Missed prompt tokens by cause, keyed as in report.json ``misses``."""
        tot = self.acc.totals
        by_cause = {
            "cold": tot.cold,
            "capacity": tot.capacity,
            "isolation": tot.isolation,
            "tail": tot.tail,
            "routing": tot.routing,
        }
        return {cause: by_cause.get(cause, 0) for cause in MISS_CAUSES}

    def _bound(self, hits: int, total: int) -> float | None:
        """An upper-bound rate; None when the replay ran without the upper bound."""
        return rate(hits, total) if self.acc.shadow.enabled else None

    def _fleet_row(self) -> dict[str, Any]:
        """Fleet columns of a sweep line (none for a single-cache replay)."""
        options = self.config.options
        if not options.is_fleet:
            return {}
        fleet = self.extra.get("fleet") or {}
        pooled = fleet.get("pooled") or {}
        serving = self.serving.report_dict() if self.serving else {}
        return {
            "replicas": options.replicas,
            "routing": options.routing_policy,
            "routing_miss_tokens": self.acc.totals.routing,
            "load_imbalance": fleet.get("load_imbalance"),
            "pooled_token_hit_rate": pooled.get("token_hit_rate"),
            "ttft_p50_s": serving.get("ttft_p50_s"),
            "ttft_p99_s": serving.get("ttft_p99_s"),
        }

    def to_report_dict(self) -> dict[str, Any]:
        tot, acc = self.acc.totals, self.acc
        config = self.config_dict()
        missed = self._missed()
        return {
            "schema_version": SCHEMA_VERSION,
            "library_version": prefixcache.__version__,
            "source": {k: self.source[k] for k in ("path", "kind", "sha256")},
            "config": config,
            "config_sha256": hashlib.sha256(
                json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
            ).hexdigest(),
            "namespaces": [ns.label() for ns in acc.namespaces],
            "replay_seconds": self.replay_seconds,
            "requests_per_second": tot.requests / self.replay_seconds
            if self.replay_seconds
            else 0.0,
            "requests": tot.requests,
            "prompt_tokens": tot.prompt_tokens,
            "hit_tokens": tot.hit_tokens,
            "token_hit_rate": rate(tot.hit_tokens, tot.prompt_tokens),
            "prompt_blocks": tot.prompt_blocks,
            "hit_blocks": tot.hit_blocks,
            "block_hit_rate": rate(tot.hit_blocks, tot.prompt_blocks),
            "upper_bound_token_hit_rate": self._bound(tot.ub_tokens, tot.prompt_tokens),
            "upper_bound_block_hit_rate": self._bound(tot.ub_blocks, tot.prompt_blocks),
            "zero_hit_requests": tot.zero_hit,
            "rejected_requests": tot.rejected,
            "truncated_outputs": self.truncated_outputs,
            "misses": missed,
            "evicted_blocks": self.stats.evicted_blocks,
            "cow_copies": self.stats.cow_copies,
            "partial_copy_tokens": tot.partial_copy_tokens,
            "peak_blocks_in_use": acc.physical_peak,
            "output_tokens": tot.output_tokens,
            "savings": self._savings(),
            "serving": self.serving.report_dict() if self.serving else None,
            "top_prefixes": acc.top_prefixes(),
            "sweep": self.sweep,
            **self.extra,
        }

    def _savings(self) -> dict[str, Any]:
        tot, acc = self.acc.totals, self.acc
        model: ModelConfig | None = self.config.model
        flops = None
        if model is not None:
            flops = float(
                2 * model.flops_params * tot.hit_tokens
                + model.attention_flops_per_pair * tot.attn_units
            )
        bpb = self.config.bytes_per_block
        shared = max(0, acc.logical_peak - acc.physical_peak)
        kv_reused = gpu_seconds = basis = None
        if model is not None and flops is not None:
            # the serving roofline's GPU, or the one --gpu names (h100-sxm), at its efficiency
            gpu = self.config.gpu or get_gpu(self.config.options.gpu)
            efficiency = gpu.compute_efficiency or DEFAULT_COMPUTE_EFFICIENCY
            kv_reused = tot.hit_tokens * model.kv_bytes_per_token
            gpu_seconds = flops / (gpu.peak_flops * efficiency)
            basis = {
                "model": model.name,
                "kv_bytes_per_token": model.kv_bytes_per_token,
                "gpu": gpu.name,
                "peak_flops": gpu.peak_flops,
                "compute_efficiency": efficiency,
            }
        return {
            "prefill_tokens_saved": tot.hit_tokens,
            "flops_saved_estimate": flops,
            "kv_bytes_not_recomputed": kv_reused,
            "gpu_seconds_saved_estimate": gpu_seconds,
            "estimate_basis": basis,
            "logical_blocks_peak": acc.logical_peak,
            "physical_blocks_peak": acc.physical_peak,
            "sharing_factor": acc.logical_peak / acc.physical_peak if acc.physical_peak else 1.0,
            "kv_bytes_saved_by_sharing": shared * bpb if bpb is not None else None,
            "internal_fragmentation_slots": acc.fragmentation_at_peak,
        }


# ---- the run directory ------------------------------------------------------------------------


def default_run_dir(name: str, root: str | Path = "runs") -> Path:
    """``runs/<name>-<YYYYmmdd-HHMMSS>`` (with a counter if that exists already)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
    base = Path(root) / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def write_run(
    result: ReplayResult, out_dir: str | Path, report: dict[str, Any] | None = None
) -> Path:
    """Write the three files of a run into ``out_dir`` (created if needed); returns it.
    ``report``: the result's report.json, when the caller has it already.

    report.json is written last, and atomically, so a directory with a report.json holds a
    complete run; a directory this call created is removed again if writing fails or
    is interrupted."""
    out = Path(out_dir)
    check_run_dir(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if report is None:
            report = result.to_report_dict()
        _write_requests(result, out / "requests.csv")
        _write_timeline(result, out / "timeline.csv")
        write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    except BaseException as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(exc, OSError):  # cannot create, disk full, ...: one error line
            raise ConfigError(f"--out {out}: {exc.strerror or exc}") from None
        raise
    return out


def check_run_dir(out: Path) -> None:
    """Raise ConfigError unless ``out`` is, or can become, a writable directory."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {parent} is not writable")


def _write_requests(result: ReplayResult, path: Path) -> None:
    labels = [ns.label() for ns in result.acc.namespaces]
    serving = result.serving
    if serving is None:
        write_requests_csv(result.acc.log, labels, path)
    else:
        write_requests_csv(result.acc.log, labels, path, serving.ttft, serving.ttft_nocache)


def _write_timeline(result: ReplayResult, path: Path) -> None:
    rows = result.acc.timeline.rows if result.acc.timeline is not None else []
    with atomic_open(path, newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(TIMELINE_COLUMNS)
        for row in rows:
            w.writerow(
                (
                    format_number(float(row[0])) if isinstance(row[0], float) else row[0],
                    *row[1:7],
                    format_number(row[7]),
                )
            )
