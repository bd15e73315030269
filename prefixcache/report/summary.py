"""The terminal summary of a run (the rich report lives in prefixcache.report)."""

from __future__ import annotations

from typing import Any


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_summary(r: dict[str, Any], run_dir: str | None = None) -> str:
    c, m, s = r["config"], r["misses"], r["savings"]
    size = f"{c['capacity_blocks']:,} blocks"
    if c["capacity_bytes"] is not None:
        size += f" ({_bytes(c['capacity_bytes'])} of {c['model']} KV)"
    prompt = r["prompt_tokens"] or 1
    lines = [
        f"replay {r['source']['path']} ({r['source']['kind']})",
        f"  {c['mode']}, block {c['block_size']} tokens, cache {size}, policy {c['policy']}",
        f"  requests        {r['requests']:,} in {r['replay_seconds']:.2f} s "
        f"({r['requests_per_second']:,.0f} req/s)",
        f"  token hit rate  {_pct(r['token_hit_rate'])}   (infinite cache: "
        f"{_pct(r['upper_bound_token_hit_rate'])})",
        f"  block hit rate  {_pct(r['block_hit_rate'])}   (infinite cache: "
        f"{_pct(r['upper_bound_block_hit_rate'])})",
        "  missed tokens   " + "  ".join(f"{k} {_pct(v / prompt)}" for k, v in m.items()),
        f"  evicted blocks  {r['evicted_blocks']:,}   CoW copies {r['cow_copies']:,}   "
        f"partial-copy tokens {r['partial_copy_tokens']:,}",
        f"  peak blocks     {r['peak_blocks_in_use']:,} in use, sharing x{s['sharing_factor']:.2f}",
    ]
    saved = f"  prefill saved   {s['prefill_tokens_saved']:,} tokens"
    if s["flops_saved_estimate"] is not None:
        saved += f", {s['flops_saved_estimate']:.3g} FLOPs"
    lines.append(saved)
    if r.get("rejected_requests"):
        lines.append(f"  rejected        {r['rejected_requests']:,} requests larger than the cache")
    sv = r.get("serving")
    if sv:
        lines.append(
            f"  TTFT            p50 {sv['ttft_p50_s']:.3f} s  p90 {sv['ttft_p90_s']:.3f} s  "
            f"p99 {sv['ttft_p99_s']:.3f} s"
        )
        lines.append(
            f"  TTFT no cache   p50 {sv['ttft_nocache_p50_s']:.3f} s  p90 "
            f"{sv['ttft_nocache_p90_s']:.3f} s  p99 {sv['ttft_nocache_p99_s']:.3f} s"
        )
        lines.append(
            f"  simulated       {sv['simulated_seconds']:.1f} s in {sv['steps']:,} steps, "
            f"{sv['preemptions']:,} preemptions"
        )
    if r.get("sweep"):
        lines.append("  sweep           capacity  block  policy  token hit  block hit  evicted")
        for row in r["sweep"]:
            lines.append(
                f"                  {row['capacity_blocks']:>8,}  {row['block_size']:>5}  "
                f"{row['policy']:>6}  {_pct(row['token_hit_rate']):>9}  "
                f"{_pct(row['block_hit_rate']):>9}  {row['evicted_blocks']:>7,}"
            )
    if r["top_prefixes"]:
        top = r["top_prefixes"][0]
        lines.append(
            f"  top prefix      {top['prefix_id']} ({top['depth_blocks']} blocks) saved "
            f"{top['tokens_saved']:,} tokens over {top['requests']:,} requests"
        )
    if run_dir:
        lines.append(f"  wrote           {run_dir}")
    return "\n".join(lines)
