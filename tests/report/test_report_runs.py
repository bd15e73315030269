"""Synthetic, self-consistent run directories for the report tests (and a check that they are).

``write_run`` produces what ``prefixcache replay`` writes: report.json whose totals are the sums of
requests.csv, and a timeline that ends at those totals.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.report.checks import consistency_checks
from prefixcache.report.run_dir import load_run, schema_problems
from prefixcache.run_format import REQUEST_COLUMNS, TIMELINE_COLUMNS, nearest_rank

BLOCK = 16
CAPACITY = 512
BYTES_PER_BLOCK = 2 * 32 * 8 * 128 * 2 * BLOCK  # K and V, 32 layers, 8 KV heads, dim 128, fp16


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _requests(rng: np.random.Generator, n: int, serving: bool) -> dict[str, np.ndarray]:
    prompt = rng.integers(20, 600, n)
    blocks = prompt // BLOCK
    hit_blocks = np.where(rng.random(n) < 0.15, 0, rng.integers(0, (prompt - 1) // BLOCK + 1))
    hit_blocks[:5] = 0  # a cold start
    missed_full = blocks - hit_blocks
    cold = rng.binomial(missed_full, 0.5)
    capacity = rng.binomial(missed_full - cold, 0.6)
    isolation = missed_full - cold - capacity
    arrival = np.cumsum(rng.exponential(0.05, n))
    cols: dict[str, np.ndarray] = {
        "request_id": np.array([f"r{i:04d}" for i in range(n)]),
        "arrival_s": np.round(arrival, 6),
        "namespace": rng.choice(["llama-3-8b", "llama-3-8b/lora-sql", "tenant-b"], n),
        "prompt_tokens": prompt,
        "hit_tokens": hit_blocks * BLOCK,
        "prompt_blocks": blocks,
        "hit_blocks": hit_blocks,
        "miss_cold": cold * BLOCK,
        "miss_capacity": capacity * BLOCK,
        "miss_isolation": isolation * BLOCK,
        "miss_tail": prompt - blocks * BLOCK,
        "miss_routing": np.zeros(n, dtype=np.int64),
        "output_tokens": rng.integers(1, 300, n),
    }
    queue = rng.exponential(0.02, n)
    cols["ttft_s"] = np.round(queue + 0.01 + (prompt - cols["hit_tokens"]) * 5e-5, 6)
    cols["ttft_nocache_s"] = np.round(queue + 0.01 + prompt * 5e-5, 6)
    if not serving:
        cols["ttft_s"] = cols["ttft_nocache_s"] = np.full(n, np.nan)
    return cols


def _timeline(rng: np.random.Generator, req: dict[str, np.ndarray], evicted: int) -> dict:
    n = len(req["arrival_s"])
    active = rng.integers(10, 120, n)
    cached = np.minimum(np.linspace(0, 380, n).astype(np.int64), CAPACITY - active)
    evict = np.zeros(n, dtype=np.int64)
    np.add.at(evict, rng.integers(n // 3, n, evicted), 1)
    p, h = np.cumsum(req["prompt_tokens"]), np.cumsum(req["hit_tokens"])
    w = min(40, n)
    rp = p - np.concatenate([np.zeros(w, dtype=np.int64), p[: n - w]])
    rh = h - np.concatenate([np.zeros(w, dtype=np.int64), h[: n - w]])
    return {
        "t": req["arrival_s"],
        "blocks_active": active,
        "blocks_cached": cached,
        "blocks_free": CAPACITY - active - cached,
        "evicted_blocks_cum": np.cumsum(evict),
        "prompt_tokens_cum": p,
        "hit_tokens_cum": h,
        "rolling_token_hit_rate": np.round(rh / rp, 6),
    }


def _sweep(kind: str, ub: float) -> list[dict[str, Any]] | None:
    if kind == "none":
        return None
    caps = [32, 64, 128, 256, 512, 1024, 2048, 4096]
    grid = [(BLOCK, "lru")]
    if kind == "full":
        grid = [(b, pol) for b in (8, 16, 32) for pol in ("lru", "lfu")]
    points = []
    for b, pol in grid:
        scale = (1.0 if pol == "lru" else 0.93) * (1.1 - b / 160)
        for c in caps:
            rate = ub * scale * (1 - np.exp(-c / 300))
            point = {
                "capacity_blocks": c,
                "token_hit_rate": round(float(rate), 6),
                "block_hit_rate": round(float(rate) * 1.02, 6),
                "evicted_blocks": int(40000 / c),
            }
            if kind == "full":
                point |= {"block_size": b, "policy": pol, "replay_seconds": 0.5}
            points.append(point)
    return points


def _write_csv(path: Path, columns: tuple[str, ...], data: dict[str, np.ndarray]) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(columns)
        for row in zip(*(data[c] for c in columns), strict=True):
            out.writerow(["" if isinstance(v, float) and np.isnan(v) else v for v in row])


def write_run(
    path: Path,
    *,
    n: int = 300,
    serving: bool = True,
    model: bool = True,
    sweep: str = "capacity",
    seed: int = 7,
) -> Path:
    """Write a run directory; ``sweep`` is 'none', 'capacity' or 'full' (block size, policy)."""
    rng = np.random.default_rng(seed)
    req = _requests(rng, n, serving)
    tot = {
        k: int(req[k].sum())
        for k in ("prompt_tokens", "hit_tokens", "prompt_blocks", "hit_blocks", "output_tokens")
    }
    misses = {
        c: int(req[f"miss_{c}"].sum()) for c in ("cold", "capacity", "isolation", "tail", "routing")
    }
    evicted = misses["capacity"] // BLOCK + 17
    ub_tok = (tot["hit_tokens"] + misses["capacity"]) / tot["prompt_tokens"]
    ub_blk = (tot["hit_blocks"] + misses["capacity"] // BLOCK) / tot["prompt_blocks"]
    ttft, nocache = req["ttft_s"], req["ttft_nocache_s"]
    config = {
        "block_size": BLOCK,
        "capacity_blocks": CAPACITY,
        "capacity_bytes": CAPACITY * BYTES_PER_BLOCK if model else None,
        "bytes_per_block": BYTES_PER_BLOCK if model else None,
        "policy": "lru",
        "mode": "serving" if serving else "sequential",
        "seed": seed,
        "hash_algo": "xxh3_128",
        "model": "llama-3-8b" if model else None,
        "partial_copy": False,
    }
    report = {
        "schema_version": 1,
        "library_version": "0.1.0",
        "source": {"path": "scenarios/chat.yaml", "kind": "scenario", "sha256": _sha("trace")},
        "config": config,
        "config_sha256": _sha(json.dumps(config, sort_keys=True)),
        "namespaces": sorted(set(req["namespace"].tolist())),
        "replay_seconds": 0.42,
        "requests_per_second": n / 0.42,
        "requests": n,
        **tot,
        "token_hit_rate": tot["hit_tokens"] / tot["prompt_tokens"],
        "block_hit_rate": tot["hit_blocks"] / tot["prompt_blocks"],
        "upper_bound_token_hit_rate": ub_tok,
        "upper_bound_block_hit_rate": ub_blk,
        "zero_hit_requests": int(np.count_nonzero(req["hit_tokens"] == 0)),
        "misses": misses,
        "evicted_blocks": evicted,
        "cow_copies": 3,
        "partial_copy_tokens": 0,
        "peak_blocks_in_use": 131,
        "savings": {
            "prefill_tokens_saved": tot["hit_tokens"],
            "flops_saved_estimate": 2 * 8.0e9 * tot["hit_tokens"] * 1.05 if model else None,
            "logical_blocks_peak": 900,
            "physical_blocks_peak": 400,
            "sharing_factor": 2.25,
            "kv_bytes_saved_by_sharing": 500 * BYTES_PER_BLOCK if model else None,
            "internal_fragmentation_slots": 37,
        },
        "serving": None
        if not serving
        else {
            **{f"ttft_p{q}_s": nearest_rank(ttft, q) for q in (50, 90, 99)},
            **{f"ttft_nocache_p{q}_s": nearest_rank(nocache, q) for q in (50, 90, 99)},
            "preemptions": 2,
            "steps": 4 * n,
            "simulated_seconds": float(req["arrival_s"][-1]),
        },
        "top_prefixes": [
            {
                "prefix_id": f"p{i}",
                "depth_blocks": 12 - i,
                "requests": 40 - 5 * i,
                "tokens_saved": (40 - 5 * i) * (12 - i) * BLOCK,
            }
            for i in range(6)
        ],
        "sweep": _sweep(sweep, ub_tok),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "report.json").write_text(json.dumps(report, indent=2))
    _write_csv(path / "requests.csv", REQUEST_COLUMNS, req)
    _write_csv(path / "timeline.csv", TIMELINE_COLUMNS, _timeline(rng, req, evicted))
    return path


@pytest.mark.parametrize(
    "serving,model,sweep", [(True, True, "capacity"), (False, False, "none"), (True, False, "full")]
)
def test_synthetic_runs_are_valid_and_consistent(
    tmp_path: Path, serving: bool, model: bool, sweep: str
) -> None:
    run = load_run(write_run(tmp_path, serving=serving, model=model, sweep=sweep))
    assert schema_problems(run.report) == []
    assert [c for c in consistency_checks(run) if not c.ok] == []
