"""Plain-text renderings: the terminal report and Markdown of a document, and the short summary
of a report.json that ``prefixcache replay`` prints.

Every function returns text or lines and writes nothing.
"""

from __future__ import annotations

import textwrap
from typing import Any

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Document, Field, Section, Table
from prefixcache.report.run_warnings import run_warnings
from prefixcache.report.serving_sections import no_tpot, same_load
from prefixcache.report.sweep_curves import miss_causes, miss_share, varying

WIDTH = 88  # characters: terminal rules and wrapped text fit in it (tables may be wider)


# ---- terminal ---------------------------------------------------------------------------------


def _rule(title: str, char: str = "─") -> str:
    """A ``WIDTH``-wide rule of ``char`` with ``title`` near its start."""
    head = f"{char * 2} {title} "
    return head + char * max(0, WIDTH - len(head))


def _field(f: Field, pad: int) -> str:
    """One figure as a line: its label padded to ``pad``, its value and note."""
    note = f"  ({f.note})" if f.note else ""
    return f"  {f.label:<{pad}}  {f.value}{note}"


def table_lines(table: Table, indent: str = "  ") -> list[str]:
    """A table as terminal lines, each starting with ``indent``: the header, a rule, the rows,
    then the caption when there is one. Columns are padded to their widest cell; numbers are
    right-aligned, text left-aligned; trailing spaces are dropped."""
    cells = [table.columns, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.columns))]

    def line(row: list[str]) -> str:
        parts = [
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
        ]
        return (indent + "  ".join(parts)).rstrip()

    lines = [line(table.columns), indent + "  ".join("─" * w for w in widths)]
    lines += [line(r) for r in table.rows]
    if table.caption:
        lines.append(f"{indent}{table.caption}")
    return lines


def _numeric(cell: str) -> bool:
    """Whether a cell reads as a number (starts with a digit or sign, no closing bracket)."""
    return bool(cell) and (cell[0].isdigit() or cell[0] in "+-") and cell[-1] not in ")"


def section_lines(section: Section) -> list[str]:
    """A section as terminal lines: a rule with its title, its figures, tables and text
    charts, then its notes wrapped at ``WIDTH``."""
    lines = [_rule(section.title)]
    pad = max((len(f.label) for f in section.fields), default=0)
    lines += [_field(f, pad) for f in section.fields]
    for table in section.tables:
        lines += ["", *table_lines(table)] if section.fields else table_lines(table)
    for chart in section.charts:
        lines += ["", f"  {chart.title}", *(f"  {line}" for line in chart.lines)]
    for note in section.notes:
        lines += textwrap.wrap(note, WIDTH, initial_indent="  ", subsequent_indent="  ")
    return lines


def render_terminal(doc: Document, definitions: bool = True) -> str:
    """The document as terminal text: title and subtitle, warnings, each section, and the
    definitions of the terms it uses unless ``definitions`` is false."""
    lines = [_rule(doc.title, "═"), f"  {doc.subtitle}", ""]
    for warning in doc.warnings:
        lines += textwrap.wrap(
            f"WARNING: {warning}", WIDTH, initial_indent="  ", subsequent_indent="           "
        )
    if doc.warnings:
        lines.append("")
    for section in doc.sections:
        lines += [*section_lines(section), ""]
    if definitions:
        lines.append(_rule("Definitions"))
        for d in doc.definitions():
            lines += textwrap.wrap(
                f"{d.term}: {d.text}", WIDTH, initial_indent="  ", subsequent_indent="    "
            )
        lines.append("")
    return "\n".join(lines)


# ---- Markdown ---------------------------------------------------------------------------------


def _escape(cell: str) -> str:
    """A Markdown table cell: ``|`` escaped, newlines as spaces."""
    return cell.replace("|", "\\|").replace("\n", " ")


def table_markdown(table: Table) -> list[str]:
    """A table as Markdown lines (first column left-aligned, the others right), then its
    caption in italics after a blank line when there is one."""
    lines = [
        "| " + " | ".join(_escape(c) for c in table.columns) + " |",
        "|" + "|".join("---" if i == 0 else "--:" for i in range(len(table.columns))) + "|",
    ]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in table.rows]
    if table.caption:
        lines += ["", f"*{table.caption}*"]
    return lines


def section_markdown(section: Section) -> list[str]:
    """A section as Markdown lines: a level-2 heading, its figures as a Figure / Value table,
    its tables, its text charts as ``text`` code blocks, then its notes."""
    lines = [f"## {section.title}", ""]
    if section.fields:
        lines += ["| Figure | Value |", "|---|--:|"]
        for f in section.fields:
            note = f" *({f.note})*" if f.note else ""
            lines.append(f"| {_escape(f.label)} | {_escape(f.value)}{note} |")
        lines.append("")
    for table in section.tables:
        lines += [*table_markdown(table), ""]
    for chart in section.charts:
        lines += [f"**{chart.title}**", "", "```text", *chart.lines, "```", ""]
    lines += [*(f"{note}\n" for note in section.notes)]
    return lines


def render_markdown(doc: Document) -> str:
    """The document as Markdown (report.md): title, subtitle, warnings as quotes, each section
    and the definitions of the terms it uses; ends with a newline."""
    lines = [f"# {doc.title}", "", doc.subtitle, ""]
    lines += [f"> **Warning:** {_escape(w)}\n" for w in doc.warnings]
    for section in doc.sections:
        lines += section_markdown(section)
    lines += ["## Definitions", ""]
    lines += [f"- **{d.term}**: {d.text}" for d in doc.definitions()]
    return "\n".join(lines) + "\n"


# ---- the summary of a replay ------------------------------------------------------------------


def format_summary(r: dict[str, Any], run_dir: str | None = None) -> str:
    """A report.json (the dict, as ``prefixcache replay`` writes it) in a dozen lines: setup,
    hit rates, misses, savings, latency, fleet, sweep, the top prefix, then ``run_dir`` when
    given and the run's warnings. No trailing newline."""
    c, m, s = r["config"], r["misses"], r["savings"]
    size = fmt.capacity_blocks(c["capacity_blocks"])
    if c["capacity_bytes"] is not None:
        size += f" ({fmt.nbytes(c['capacity_bytes'], digits=1)} of {c['model']} KV)"
    if r.get("fleet"):
        size += " per replica"
    prompt = r["prompt_tokens"] or 1
    lines = [
        f"replay {r['source']['path']} ({r['source']['kind']})",
        f"  {c['mode']}, block {c['block_size']} tokens, cache {size}, policy {c['policy']}",
        f"  requests        {r['requests']:,} in {r['replay_seconds']:.2f} s "
        f"({r['requests_per_second']:,.0f} req/s)",
        f"  token hit rate  {fmt.pct(r['token_hit_rate'])}   (infinite cache: "
        f"{fmt.pct(r['upper_bound_token_hit_rate'])})",
        f"  block hit rate  {fmt.pct(r['block_hit_rate'])}   (infinite cache: "
        f"{fmt.pct(r['upper_bound_block_hit_rate'])})",
        "  missed tokens   " + "  ".join(f"{k} {fmt.pct(v / prompt)}" for k, v in m.items()),
        f"  evicted blocks  {r['evicted_blocks']:,}   CoW copies {r['cow_copies']:,}   "
        f"partial-copy tokens {r['partial_copy_tokens']:,}",
        f"  peak blocks     {r['peak_blocks_in_use']:,} in use, sharing x{s['sharing_factor']:.2f}",
    ]
    saved = f"  prefill saved   {s['prefill_tokens_saved']:,} tokens"
    if s["flops_saved_estimate"] is not None:
        saved += f", {s['flops_saved_estimate']:.3g} FLOPs"
    lines.append(saved)
    basis = s.get("estimate_basis")
    if basis:
        lines.append(
            f"  estimated       {s['gpu_seconds_saved_estimate']:,.0f} GPU-seconds and "
            f"{fmt.nbytes(s['kv_bytes_not_recomputed'])} of K/V not recomputed "
            f"({basis['model']}, {basis['gpu']} at {basis['compute_efficiency']:.0%} of peak)"
        )
    tiers = r.get("tiers")
    if tiers:
        lines.append(
            f"  hits by tier    GPU {fmt.pct(tiers['gpu_token_hit_rate'])}, host "
            f"{fmt.pct(tiers['host_token_hit_rate'])}, pool {fmt.pct(tiers['pool_token_hit_rate'])}"
            f"; {tiers['net_prefill_seconds_saved']:.3g} s prefill saved net of "
            f"{tiers['transfer_seconds']:.3g} s of transfers"
        )
    if r.get("rejected_requests"):
        lines.append(f"  rejected        {r['rejected_requests']:,} requests larger than the cache")
    sv = r.get("serving")
    if sv and sv.get("benchmark"):
        lines += _serving_lines(c, sv)
    elif sv:
        lines.append(
            f"  TTFT            p50 {sv['ttft_p50_s']:.3f} s  p90 {sv['ttft_p90_s']:.3f} s  "
            f"p99 {sv['ttft_p99_s']:.3f} s"
        )
        lines.append(
            f"  TTFT no cache   p50 {sv['ttft_nocache_p50_s']:.3f} s  p90 "
            f"{sv['ttft_nocache_p90_s']:.3f} s  p99 {sv['ttft_nocache_p99_s']:.3f} s"
        )
    if sv:
        lines.append(
            f"  simulated       {sv['simulated_seconds']:.1f} s in {sv['steps']:,} steps, "
            f"{sv['preemptions']:,} preemptions"
        )
    fl = r.get("fleet")
    if fl:
        lines.append(
            f"  fleet           {fl['replicas']} replicas, routing {fl['routing']}, "
            f"load imbalance {fl['load_imbalance']:.2f} (max/mean busy time)"
        )
        for rep in fl["per_replica"]:
            lines.append(
                f"    {rep['name']:<12}  {rep['requests']:>7,} req  "
                f"busy {rep['busy_seconds']:8.1f} s  "
                f"hit {fmt.pct(rep['token_hit_rate']):>6}  TTFT p50 {rep['ttft_p50_s']:.3f} s  "
                f"p99 {rep['ttft_p99_s']:.3f} s"
            )
        attribution = fl.get("attribution")
        if attribution:
            prompt_total = attribution["prompt_tokens"] or 1
            lines.append(
                "  reuse           "
                + "  ".join(
                    f"{k} {fmt.pct(attribution[f'{k}_tokens'] / prompt_total)}"
                    for k in ("available", "captured", "delivered")
                )
                + " (delivered = captured in a replay)"
            )
        pooled = fl["pooled"]
        if pooled:
            lines.append(
                f"  pooled cache    hit {fmt.pct(pooled['token_hit_rate'])} "
                f"(one replica, {fmt.capacity_blocks(pooled['capacity_blocks'])}, "
                f"{fl['replicas']}x compute)"
            )
    lines += _tenant_lines(r.get("tenants"))
    # the keys that tell the sweep's points apart besides the ones every table shows
    sweep_keys = [
        (k, label)
        for k, label in (("host_blocks", "host"), ("pool_blocks", "pool"))
        if r.get("sweep") and varying(r["sweep"], k)
    ]
    if r.get("sweep") and any("replicas" in row for row in r["sweep"]):
        if varying(r["sweep"], "capacity_blocks"):
            sweep_keys.insert(0, ("capacity_blocks", "capacity"))
        lines.append(
            "  sweep          "
            + "".join(f" {label:>8}" for _, label in sweep_keys)
            + " replicas  routing          token hit  pooled  routing miss  imbalance  TTFT p50"
        )
        for row in r["sweep"]:
            pooled_rate = row.get("pooled_token_hit_rate")
            lines.append(
                "               "
                + "".join(f" {_sweep_cell(row, k):>8}" for k, _ in sweep_keys)
                + f"   {row.get('replicas', 1):>8}  {row.get('routing') or '-':<15}  "
                f"{fmt.pct(row['token_hit_rate']):>9}  "
                f"{fmt.pct(pooled_rate) if pooled_rate is not None else '-':>6}  "
                f"{row.get('routing_miss_tokens', 0):>12,}  "
                f"{row.get('load_imbalance') or 1.0:>9.2f}  "
                f"{row.get('ttft_p50_s') or 0.0:>6.3f} s"
            )
    elif r.get("sweep"):
        causes = miss_causes(r["sweep"])
        lines.append(
            "  sweep           capacity  block  policy"
            + "".join(f"  {label:>8}" for _, label in sweep_keys)
            + "  token hit  block hit  evicted"
            + "".join(f"  {c + ' miss':>13}" for c in causes)
        )
        for row in r["sweep"]:
            lines.append(
                f"                 {fmt.capacity(row['capacity_blocks']):>9}  "
                f"{row['block_size']:>5}  {row['policy']:>6}"
                + "".join(f"  {row.get(k, 0):>8,}" for k, _ in sweep_keys)
                + f"  {fmt.pct(row['token_hit_rate']):>9}  "
                f"{fmt.pct(row['block_hit_rate']):>9}  {row['evicted_blocks']:>7,}"
                + "".join(f"  {fmt.pct(miss_share(row, c)):>13}" for c in causes)
            )
    if r["top_prefixes"]:
        top = r["top_prefixes"][0]
        lines.append(
            f"  top prefix      {top['prefix_id']} ({top['depth_blocks']} blocks) saved "
            f"{top['tokens_saved']:,} tokens over {fmt.plural(top['requests'], 'request')}"
        )
    if run_dir:
        lines.append(f"  wrote           {run_dir}")
    for warning in run_warnings(r):
        lines += textwrap.wrap(
            f"WARNING: {warning}", WIDTH, initial_indent="  ", subsequent_indent="           "
        )
    return "\n".join(lines)


def _tenant_lines(tenants: dict[str, Any] | None) -> list[str]:
    """Per tenant: hit rate (and without shares, when the replay compared), blocks a neighbour
    evicted and the tokens that cost it; at most eight tenants, the busiest."""
    if not tenants or not tenants.get("rows"):
        return []
    rows = sorted(tenants["rows"], key=lambda t: -t["prompt_tokens"])
    compared = tenants.get("compared_without_shares")
    lines = [
        "  tenants         hit rate"
        + ("  (no shares)" if compared else "")
        + "  evicted by others  neighbour's misses"
    ]
    for t in rows[:8]:
        name = "(no salt)" if t["tenant"] is None else str(t["tenant"])
        cell = f"    {name[:13]:<13} {fmt.pct(t['token_hit_rate']):>8}"
        if compared:
            cell += f"  {fmt.pct(t['without_shares']['token_hit_rate']):>11}"
        cell += (
            f"  {t['evicted_by_others_blocks']:>10,} blocks"
            f"  {t['noisy_neighbour_tokens']:>11,} tokens"
        )
        lines.append(cell)
    if len(rows) > 8:
        lines.append(f"    ... {len(rows) - 8} more in the report")
    return lines


def _serving_lines(c: dict[str, Any], sv: dict[str, Any]) -> list[str]:
    """Benchmark figures with and without the cache, the load and the assumptions."""
    a, b = sv["benchmark"]["with_cache"], sv["benchmark"]["without_cache"]

    def lat(d: dict[str, Any], name: str) -> str:
        if name == "tpot" and no_tpot(d):
            return "n/a (no request has more than one output token)"
        return "  ".join(f"{s} {_dur(d[f'{name}_{s}_s'])}" for s in ("mean", "p50", "p90", "p99"))

    model = f"{c['model']}{' (default)' if c.get('model_defaulted') else ''}"
    gpu = f"{c.get('tp', 1)} x {c['gpu']}" if c.get("tp", 1) > 1 else c["gpu"]
    if c.get("gpu_profile"):
        gpu += f" (profile {c['gpu_profile']})"
    assume = sv.get("assumptions") or {}
    lines = [
        f"  serving setup   {model} on {gpu}, token budget {c['token_budget']:,}, "
        f"max seqs {c['max_seqs']:,}, MFU {assume.get('compute_efficiency', 0):.0%}, "
        f"bandwidth eff. {assume.get('memory_efficiency', 0):.0%}",
    ]
    if c.get("rate_scale") is not None:
        lines.append(f"  arrivals        rate x{c['rate_scale']:g}, time x{c['time_scale']:g}")
    load = sv.get("load") or {}
    if load.get("offered_load") is not None and load.get("replicas", 1) > 1:
        nocache = (
            "the same without the cache"
            if same_load(load)
            else f"{load['offered_load_nocache']:.2f}x without"
        )
        lines.append(
            f"  offered load    {load['offered_load']:.2f}x per replica with cache (busiest "
            f"{load['offered_load_busiest']:.2f}x), {nocache} "
            f"(GPU busy {load['busy_s']:,.1f} s over {load['replicas']} replicas / arrivals "
            f"over {load['arrival_span_s']:,.1f} s)"
        )
    elif load.get("offered_load") is not None:
        offered = (
            f"{load['offered_load']:.2f}x, the same with and without the cache"
            if same_load(load)
            else f"{load['offered_load']:.2f}x with cache, "
            f"{load['offered_load_nocache']:.2f}x without"
        )
        lines.append(
            f"  offered load    {offered} (GPU busy "
            f"{load['busy_s']:,.1f} s / arrivals over {load['arrival_span_s']:,.1f} s)"
        )
    for label, d in (("with cache", a), ("no cache", b)):
        lines += [
            f"  {label:<15} {d['request_throughput_rps']:,.2f} req/s, "
            f"{d['output_token_throughput_tps']:,.0f} output tok/s, "
            f"{d['total_token_throughput_tps']:,.0f} total tok/s",
            f"    TTFT          {lat(d, 'ttft')}",
            f"    TPOT          {lat(d, 'tpot')}",
            f"    E2E           {lat(d, 'e2e')}",
        ]
    return lines


def _dur(x: float) -> str:
    """``x`` seconds as ms below 10 s, else as seconds."""
    return f"{1000 * x:.1f} ms" if x < 10 else f"{x:,.1f} s"


def _sweep_cell(row: dict[str, Any], key: str) -> str:
    """A sweep point's size in blocks ("unbounded" for a cache that never runs out)."""
    value = row.get(key, 0)
    return fmt.capacity(value) if key == "capacity_blocks" else f"{value:,}"
