"""Trace statistics and the infinite-cache whole-block hit rate, in one streaming pass.

The infinite-cache hit rate counts whole blocks only: every full block whose prefix was seen
before. A replay with partial-block copies on (the default) also reuses the leading tokens of a
partially matching block, so its hit rate can exceed this figure; the replay's own upper bound
adds the copies it made.
"""

from __future__ import annotations

import time
from array import array
from typing import Any

import numpy as np

from prefixcache.replay.model_specs import ModelConfig
from prefixcache.replay.sim.accounting import Shadow
from prefixcache.replay.workload.sources import Source
from prefixcache.report.formatting import pct


def _dist(values: array) -> dict[str, float]:
    if not len(values):
        return {"total": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0}
    x = np.frombuffer(values, dtype=np.int64)
    p50, p90, p99 = np.percentile(x, [50, 90, 99]).tolist()
    return {
        "total": int(x.sum()),
        "mean": float(x.mean()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(x.max()),
    }


def analyze_source(
    source: Source, block_sizes: list[int], model: ModelConfig | None = None
) -> dict[str, Any]:
    shadows = [Shadow(p, source.multi_namespace) for p in block_sizes]
    sums = [[0, 0, 0, 0] for _ in block_sizes]  # prompt blocks, ub blocks, ub tokens, tail tokens
    prompts, outputs = array("q"), array("q")
    namespaces: dict[Any, None] = {}
    first = last = None
    start = time.perf_counter()
    for req in source:
        t = len(req.tokens)
        prompts.append(t)
        outputs.append(req.output_len * req.n)
        namespaces.setdefault(req.namespace, None)
        first = req.arrival_s if first is None else first
        last = req.arrival_s
        buf = req.tokens.tobytes()
        # a session's next prompt starts with this answer: the replay caches it (all but the last
        # sampled token, whose K/V is never written), and so does the shadow here
        grown = None
        if req.output_tokens is not None and req.output_len > 1:
            grown = buf + req.output_tokens[: req.output_len - 1].tobytes()
        for p, shadow, acc in zip(block_sizes, shadows, sums, strict=True):
            f = t // p
            _, u, _ = shadow.observe(buf, f, req.namespace)
            acc[0] += f
            acc[1] += u
            acc[2] += u * p if u < f else (t - 1 if f * p == t else f * p)
            acc[3] += t - f * p
            if grown is not None:
                shadow.observe(grown, len(grown) // 4 // p, req.namespace)
    total_prompt = int(sum(prompts))
    per_block = []
    for p, shadow, (blocks, ub_blocks, ub_tokens, tail) in zip(
        block_sizes, shadows, sums, strict=True
    ):
        row: dict[str, Any] = {
            "block_size": p,
            "prompt_blocks": blocks,
            "unique_blocks": shadow.unique_blocks,
            "upper_bound_token_hit_rate": ub_tokens / total_prompt if total_prompt else 0.0,
            "upper_bound_block_hit_rate": ub_blocks / blocks if blocks else 0.0,
            "partial_tail_tokens": tail,
        }
        if model is not None:
            row["working_set_bytes"] = shadow.unique_blocks * model.bytes_per_block(p)
        per_block.append(row)
    duration = (last - first) if first is not None and last is not None else 0.0
    return {
        "source": {"path": source.path, "kind": source.kind, "sha256": source.sha256()},
        "requests": len(prompts),
        "duration_s": duration,
        "arrival_rate_per_s": (len(prompts) - 1) / duration if duration > 0 else None,
        "namespaces": [ns.label() for ns in namespaces],
        "prompt_tokens": _dist(prompts),
        "output_tokens": _dist(outputs),
        "model": model.name if model else None,
        "infinite_cache": per_block,
        "analyze_seconds": time.perf_counter() - start,
    }


def format_analysis(a: dict[str, Any]) -> str:
    pt, ot = a["prompt_tokens"], a["output_tokens"]
    rate = a["arrival_rate_per_s"]
    lines = [
        f"analyze {a['source']['path']} ({a['source']['kind']})",
        f"  requests       {a['requests']:,} over {a['duration_s']:,.1f} s"
        + (f" ({rate:,.2f} req/s)" if rate else ""),
        f"  namespaces     {len(a['namespaces'])}: "
        + ", ".join(a["namespaces"][:5])
        + (" ..." if len(a["namespaces"]) > 5 else ""),
        f"  prompt tokens  total {pt['total']:,}  mean {pt['mean']:,.1f}  p50 {pt['p50']:,.0f}  "
        f"p90 {pt['p90']:,.0f}  p99 {pt['p99']:,.0f}  max {pt['max']:,}",
        f"  output tokens  total {ot['total']:,}  mean {ot['mean']:,.1f}  p50 {ot['p50']:,.0f}  "
        f"p99 {ot['p99']:,.0f}  max {ot['max']:,}",
        "  infinite cache, whole blocks only (partial-block copies in a replay can add to it):",
        "    block  token hit  block hit  prompt blocks  unique blocks"
        + ("  working set" if a["model"] else ""),
    ]
    for row in a["infinite_cache"]:
        line = (
            f"    {row['block_size']:>5}  {pct(row['upper_bound_token_hit_rate']):>9}  "
            f"{pct(row['upper_bound_block_hit_rate']):>9}  {row['prompt_blocks']:>13,}  "
            f"{row['unique_blocks']:>13,}"
        )
        if "working_set_bytes" in row:
            line += f"  {row['working_set_bytes'] / 2**30:>8.2f} GiB"
        lines.append(line)
    return "\n".join(lines)
