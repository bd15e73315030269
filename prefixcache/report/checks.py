"""Cross-checks between report.json and the CSV files: every total is recomputed from the rows."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from prefixcache.report.run_dir import Run
from prefixcache.run_format import MISS_CAUSES, rate

RATE_TOLERANCE = 1e-9


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str


def _equal(name: str, reported: Any, recomputed: Any) -> Check:
    if isinstance(reported, float) or isinstance(recomputed, float):
        ok = abs(float(reported) - float(recomputed)) <= RATE_TOLERANCE
    else:
        ok = int(reported) == int(recomputed)
    return Check(name, ok, f"report.json {reported}, recomputed {recomputed}")


def consistency_checks(run: Run) -> list[Check]:
    r, req, tl = run.report, run.request_totals, run.timeline
    total = {
        c: req.sums[c]
        for c in ("prompt_tokens", "hit_tokens", "prompt_blocks", "hit_blocks", "output_tokens")
    }
    missed = r["prompt_tokens"] - r["hit_tokens"]
    checks = [
        _equal("requests = rows of requests.csv", r["requests"], run.num_requests),
        *(_equal(f"{k} = sum over requests", r[k], v) for k, v in total.items()),
        _equal(
            "zero_hit_requests = rows with no hit",
            r["zero_hit_requests"],
            req.zero_hit_rows,
        ),
        *(
            _equal(f"misses.{c} = sum over requests", r["misses"][c], req.sums[f"miss_{c}"])
            for c in MISS_CAUSES
        ),
        _equal("misses add up to prompt − hit tokens", missed, sum(r["misses"].values())),
        Check(
            "each request's misses add up to its prompt − hit tokens",
            req.rows_add_up,
            "checked row by row",
        ),
        _equal(
            "token_hit_rate = hit / prompt tokens",
            r["token_hit_rate"],
            rate(r["hit_tokens"], r["prompt_tokens"]),
        ),
        _equal(
            "block_hit_rate = hit / prompt blocks",
            r["block_hit_rate"],
            rate(r["hit_blocks"], r["prompt_blocks"]),
        ),
        _equal(
            "prefill tokens saved = hit tokens",
            r["savings"]["prefill_tokens_saved"],
            r["hit_tokens"],
        ),
    ]
    if r["upper_bound_token_hit_rate"] is not None:  # None: replayed without the upper bound
        checks.append(
            Check(
                "hit rates within their upper bounds",
                r["token_hit_rate"] <= r["upper_bound_token_hit_rate"] + RATE_TOLERANCE
                and r["block_hit_rate"] <= r["upper_bound_block_hit_rate"] + RATE_TOLERANCE,
                "token and block",
            )
        )
    checks += _savings_checks(r)
    if len(tl["t"]):
        states = tl["blocks_active"] + tl["blocks_cached"] + tl["blocks_free"]
        replicas = int(r["config"].get("replicas") or 1)  # a fleet's timeline adds its replicas
        capacity = r["config"]["capacity_blocks"] * replicas
        checks += [
            Check(
                "active + cached + free = capacity at every sample",
                bool(np.all(states == capacity)),
                f"capacity {capacity}" + (f" ({replicas} replicas)" if replicas > 1 else ""),
            ),
            _equal(
                "timeline ends at all prompt tokens",
                r["prompt_tokens"],
                int(tl["prompt_tokens_cum"][-1]),
            ),
            _equal(
                "timeline ends at all hit tokens", r["hit_tokens"], int(tl["hit_tokens_cum"][-1])
            ),
            _equal(
                "timeline ends at all evictions",
                r["evicted_blocks"],
                int(tl["evicted_blocks_cum"][-1]),
            ),
        ]
    return checks


def _savings_checks(r: dict[str, Any]) -> list[Check]:
    s, cfg = r["savings"], r["config"]
    logical, physical = s["logical_blocks_peak"], s["physical_blocks_peak"]
    out = []
    if physical:
        out.append(
            _equal(
                "sharing factor = logical / physical blocks",
                float(s["sharing_factor"]),
                logical / physical,
            )
        )
    if cfg["bytes_per_block"] is not None:
        bpb = cfg["bytes_per_block"]
        if s["kv_bytes_saved_by_sharing"] is not None:
            out.append(
                _equal(
                    "KV bytes saved = (logical − physical) × bytes per block",
                    s["kv_bytes_saved_by_sharing"],
                    max(0, logical - physical) * bpb,
                )
            )
        if cfg["capacity_bytes"] is not None:
            out.append(
                _equal(
                    "capacity bytes = blocks × bytes per block",
                    cfg["capacity_bytes"],
                    cfg["capacity_blocks"] * bpb,
                )
            )
    return out
