"""Every figure in the terminal, Markdown and HTML reports agrees with report.json and the CSVs.

Expected values are recomputed here from the raw files, independently of the report code; a
displayed value must match to the precision it is printed with.
"""

from __future__ import annotations

import csv
import html
import json
import math
import re
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from test_report_runs import write_run

from prefixcache.report import DEFINITIONS, build_document, load_run
from prefixcache.report.render.html import render_html
from prefixcache.report.render.text_formats import render_markdown, render_terminal

Rows = dict[str, list[list[str]]]
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_UNITS = {
    "%": 0.01,
    "pp": 0.01,
    "ms": 1e-3,
    "s": 1.0,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "B": 1.0,
    "MFLOP": 1e6,
    "GFLOP": 1e9,
    "TFLOP": 1e12,
    "PFLOP": 1e15,
    "EFLOP": 1e18,
    "FLOP": 1.0,
    "×": 1.0,
}


def shown(cell: str, expected: float) -> bool:
    """Does the first number in ``cell`` (with its unit) print ``expected``, to its precision?"""
    m = _NUMBER.search(cell)
    assert m is not None, f"no number in {cell!r}"
    text = m.group().replace(",", "")
    unit = re.match(r"\s*(%|pp|ms|s\b|[KMGT]iB|B\b|[MGTPE]?FLOP|×)?", cell[m.end() :]).group(1)
    scale = _UNITS.get(unit or "", 1.0)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) * scale - expected) <= 0.5 * 10**-decimals * scale * 1.0001


def terminal_rows(text: str) -> Rows:
    rows: Rows = defaultdict(list)
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            cells = re.split(r"\s{2,}", line.strip())
            rows[cells[0]].append(cells[1:])
    return rows


def markdown_rows(text: str) -> Rows:
    rows: Rows = defaultdict(list)
    for line in text.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]].append(cells[1:])
    return rows


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: Rows = defaultdict(list)
        self.row: list[str] | None = None
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.row is not None and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.row:
            self.rows[self.row[0]].append(self.row[1:])
            self.row = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def html_rows(text: str) -> Rows:
    parser = _Cells()
    parser.feed(text)
    return parser.rows


def _nearest_rank(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def expected_figures(run_dir: Path) -> dict[str, float | None]:
    """Label -> value of its first number, from the raw files."""
    report = json.loads((run_dir / "report.json").read_text())
    with (run_dir / "requests.csv").open() as f:
        req = list(csv.DictReader(f))
    with (run_dir / "timeline.csv").open() as f:
        tl = list(csv.DictReader(f))

    def total(col: str) -> int:
        return sum(int(r[col]) for r in req)

    prompt, hits = total("prompt_tokens"), total("hit_tokens")
    pblocks, hblocks = total("prompt_blocks"), total("hit_blocks")
    missed = prompt - hits
    ub_t, ub_b = report["upper_bound_token_hit_rate"], report["upper_bound_block_hit_rate"]
    ratios = [int(r["hit_tokens"]) / int(r["prompt_tokens"]) for r in req]
    s, sv = report["savings"], report["serving"]
    out: dict[str, float | None] = {
        "Requests": len(req),
        "Prompt tokens": prompt,
        "Hit tokens": hits,
        "Token hit rate": hits / prompt,
        "Token hit rate upper bound": ub_t,
        "Token hit rate achieved / upper bound": hits / prompt / ub_t,
        "Prompt blocks": pblocks,
        "Hit blocks": hblocks,
        "Block hit rate": hblocks / pblocks,
        "Block hit rate upper bound": ub_b,
        "Block hit rate achieved / upper bound": hblocks / pblocks / ub_b,
        "Output tokens": total("output_tokens"),
        **{f"Per-request hit ratio p{q}": _nearest_rank(ratios, q) for q in (50, 90, 99)},
        "Requests with zero hits": sum(int(r["hit_tokens"]) == 0 for r in req),
        **{
            f"{c.capitalize()} miss": total(f"miss_{c}")
            for c in ("cold", "capacity", "isolation", "tail", "routing")
        },
        "All misses": missed,
        "Prefill tokens saved": hits,
        "FLOPs saved": s["flops_saved_estimate"],
        "Logical blocks (peak)": s["logical_blocks_peak"],
        "Physical blocks (peak)": s["physical_blocks_peak"],
        "Sharing factor": s["sharing_factor"],
        "KV bytes saved by sharing": s["kv_bytes_saved_by_sharing"],
        "Internal fragmentation": s["internal_fragmentation_slots"],
        "Copy-on-write copies": report["cow_copies"],
        "Partially copied tokens": report["partial_copy_tokens"],
        "Evicted blocks": int(tl[-1]["evicted_blocks_cum"]),
        "Peak blocks in use": report["peak_blocks_in_use"],
        "Capacity": report["config"]["capacity_blocks"],
        "Block size": report["config"]["block_size"],
        "Active blocks (peak / end)": max(int(r["blocks_active"]) for r in tl),
        "Cached blocks (peak / end)": max(int(r["blocks_cached"]) for r in tl),
        "Free blocks (lowest / end)": min(int(r["blocks_free"]) for r in tl),
        "Rolling hit rate (start → end)": float(tl[0]["rolling_token_hit_rate"]),
    }
    assert (
        sum(out[f"{c} miss"] for c in ("Cold", "Capacity", "Isolation", "Tail", "Routing"))
        == missed
    )
    if sv is not None:
        out |= {f"p{q}": sv[f"ttft_p{q}_s"] for q in (50, 90, 99)}
        out |= {"Preemptions": sv["preemptions"], "Scheduler steps": sv["steps"]}
    if sv is not None and "benchmark" in sv:  # written by the replay itself
        for q in (50, 90, 99):
            del out[f"p{q}"]
        bench = sv["benchmark"]["with_cache"]
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency")):
            out |= {f"{label} {q}": bench[f"{name}_{q}_s"] for q in ("mean", "p50", "p90", "p99")}
        out |= {
            "Completed requests": bench["completed"],
            "Request throughput (req/s)": bench["request_throughput_rps"],
            "Total token throughput (tok/s)": bench["total_token_throughput_tps"],
            "Offered load": sv["load"]["offered_load"],
        }
        assert sv["benchmark"]["with_cache"]["ttft_p50_s"] == sv["ttft_p50_s"]
    for p in report["top_prefixes"]:
        out[str(p["prefix_id"])] = p["depth_blocks"]
    return out


def _check(rows: Rows, expected: dict[str, float | None], fmt_name: str) -> None:
    for label, value in expected.items():
        assert label in rows, f"{fmt_name}: figure {label!r} missing"
        for cells in rows[label]:
            if value is None:
                assert cells[0].startswith("n/a"), (fmt_name, label, cells)
            else:
                assert shown(cells[0], value), (
                    f"{fmt_name}: {label} shows {cells[0]!r}, expected {value}"
                )


@pytest.fixture(
    scope="module",
    params=[
        dict(serving=True, model=True, sweep="capacity"),
        dict(serving=False, model=False, sweep="full"),
    ],
    ids=["serving", "sequential"],
)
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    run_dir = write_run(tmp_path_factory.mktemp("run"), **request.param)
    run = load_run(run_dir)
    doc = build_document(run)
    return run_dir, {
        "terminal": render_terminal(doc),
        "markdown": render_markdown(doc),
        "html": render_html(doc, run),
    }


def test_every_figure_matches_the_raw_files(rendered: tuple[Path, dict[str, str]]) -> None:
    run_dir, texts = rendered
    expected = expected_figures(run_dir)
    _check(terminal_rows(texts["terminal"]), expected, "terminal")
    _check(markdown_rows(texts["markdown"]), expected, "markdown")
    _check(html_rows(texts["html"]), expected, "html")


def test_miss_shares_and_prefix_savings(rendered: tuple[Path, dict[str, str]]) -> None:
    run_dir, texts = rendered
    report = json.loads((run_dir / "report.json").read_text())
    missed = report["prompt_tokens"] - report["hit_tokens"]
    rows = markdown_rows(texts["markdown"])
    for cause, n in report["misses"].items():
        tokens, share, of_prompt = rows[f"{cause.capitalize()} miss"][0]
        assert (
            shown(tokens, n)
            and shown(share, n / missed)
            and shown(of_prompt, n / report["prompt_tokens"])
        )
    for p in report["top_prefixes"]:
        _depth, requests, saved, share = rows[str(p["prefix_id"])][0]
        assert shown(requests, p["requests"]) and shown(saved, p["tokens_saved"])
        assert shown(share, p["tokens_saved"] / report["hit_tokens"])


def test_knee_and_consistency(rendered: tuple[Path, dict[str, str]]) -> None:
    run_dir, texts = rendered
    report = json.loads((run_dir / "report.json").read_text())
    rows = terminal_rows(texts["terminal"])
    checks = rows["Consistency checks"][0][0]
    passed, total = map(int, re.findall(r"\d+", checks))
    assert passed == total >= 20
    knee_rows = [k for k in rows if k.startswith("Knee") and rows[k][0]]
    if report["sweep"] is not None and len({p.get("policy") for p in report["sweep"]}) == 1:
        # one curve: the knee is the point furthest above the chord, capacity on a log axis
        pts = sorted(report["sweep"], key=lambda p: p["capacity_blocks"])
        xs = [math.log2(p["capacity_blocks"]) for p in pts]
        ys = [p["token_hit_rate"] for p in pts]
        gap = [
            (y - ys[0]) / (ys[-1] - ys[0]) - (x - xs[0]) / (xs[-1] - xs[0])
            for x, y in zip(xs, ys, strict=True)
        ]
        best = pts[gap.index(max(gap))]
        assert shown(rows["Knee"][0][0], best["capacity_blocks"])
    else:
        assert len(knee_rows) == 6  # three block sizes × two policies


def test_definitions_shown_once_in_every_format(rendered: tuple[Path, dict[str, str]]) -> None:
    _, texts = rendered
    core = [
        "hit_tokens",
        "token_hit_rate",
        "block_hit_rate",
        "upper_bound",
        "achieved",
        "request_hit_ratio",
        "misses",
        "miss_cold",
        "miss_capacity",
        "miss_isolation",
        "miss_tail",
        "miss_routing",
        "prefill_tokens_saved",
        "flops_saved",
        "sharing_factor",
        "kv_bytes_saved",
        "fragmentation",
        "cow_copies",
        "rolling_hit_rate",
        "knee",
    ]
    flat = {
        "terminal": " ".join(texts["terminal"].split()),
        "markdown": texts["markdown"],
        "html": html.unescape(texts["html"].split('id="definitions"')[1]),
    }
    for name, text in flat.items():
        for key in core:
            assert text.count(DEFINITIONS[key].text) == 1, (name, key)
