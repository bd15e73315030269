"""A fleet replay's report, read as a planner reads it: no raw field names as headers, one
word per pool, the pooled line's footnote saying what it gets, no tier that was not asked for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.report import build_document, load_run
from prefixcache.report.render.text_formats import render_markdown

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


@pytest.fixture(scope="module")
def fleet_report(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("fleet") / "run"
    args = ["replay", str(TRACE), "--mode", "serving", "--replicas", "4"]
    args += ["--model", "llama-3.1-8b", "--kv-memory", "2GiB,8GiB", "--pool-memory", "64GiB"]
    args += ["--pool-write", "through", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    return render_markdown(build_document(load_run(out)))


def table_header(markdown: str, first: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {first} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_sweep_headers_are_words_not_field_names(fleet_report: str) -> None:
    header = table_header(fleet_report, "Capacity (blocks)")
    raw = [h for h in header if re.search(r"\b(Gpu|Ttft|p50 s|p99 s)\b", h) or "_" in h]
    assert not raw, raw
    assert "Hits loaded from the shared pool" in header
    assert "One replica of the fleet's size: token hit rate" in header
    assert "TTFT p99" in header and "Arrivals outrun the GPUs" in header
    assert "Knee" not in header  # two capacities: no knee to mark
    row = next(line for line in fleet_report.splitlines() if line.startswith("| 32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[header.index("Arrivals outrun the GPUs")] in ("yes", "no")
    assert cells[header.index("TTFT p99")].endswith((" s", " ms"))


def test_the_pooled_line_says_it_shares_the_pool(fleet_report: str) -> None:
    assert "and the same shared pool (written as computed)" in fleet_report


def test_a_tier_not_asked_for_is_not_shown(fleet_report: str) -> None:
    tiers = fleet_report.split("## Memory tiers", 1)[1].split("\n## ", 1)[0]
    assert "Shared pool" in tiers and "Host tier" not in tiers
    assert "| Pool |" not in tiers  # "pool" alone is the GPU's block pool elsewhere
