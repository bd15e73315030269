"""End to end: ``prefixcache replay`` writes a run whose reports agree with its own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_figures import (
    _check,
    expected_figures,
    html_rows,
    markdown_rows,
    shown,
    terminal_rows,
)

from prefixcache.cli import main
from prefixcache.report import consistency_checks, load_run

SCENARIO = """\
name: tiny-chat
seed: 3
requests: 120
vocab_size: 5000
arrivals: {process: poisson, rate: 20}
namespace: {model: tiny-model, tenants: 2}
prompt:
  - shared: {length: 64, variants: 2}
  - pool: {size: 8, pick: 1, length: 48}
  - unique: {length: {dist: uniform, low: 5, high: 40}}
output: 16
"""


def replay(tmp_path: Path, *args: str) -> Path:
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "run"
    code = main(["replay", str(scenario), "--out", str(out), "--jobs", "1", "--no-progress", *args])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return replay(
        tmp_path_factory.mktemp("replay"),
        "--blocks",
        "24,48,96",
        "--block-size",
        "16,32",
        "--policy",
        "lru,lfu",
    )


def test_replay_writes_the_full_report(sweep_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("report.json", "requests.csv", "timeline.csv", "report.md", "report.html"):
        assert (sweep_run / name).is_file(), name
    run = load_run(sweep_run)  # validates report.json against the schema
    assert [c for c in consistency_checks(run) if not c.ok] == []
    capsys.readouterr()
    assert main(["report", str(sweep_run)]) == 0
    expected = expected_figures(sweep_run)
    _check(terminal_rows(capsys.readouterr().out), expected, "terminal")
    _check(markdown_rows((sweep_run / "report.md").read_text()), expected, "markdown")
    _check(html_rows((sweep_run / "report.html").read_text()), expected, "html")


def test_sweep_rows_match_the_replay(sweep_run: Path) -> None:
    report = json.loads((sweep_run / "report.json").read_text())
    rows = markdown_rows((sweep_run / "report.md").read_text())
    assert len(report["sweep"]) == 12
    for p in report["sweep"]:
        cap = f"{p['capacity_blocks']:,}"
        row = next(r for r in rows[cap] if r[:2] == [str(p["block_size"]), p["policy"]])
        assert shown(row[2], p["token_hit_rate"]) and shown(row[3], p["block_hit_rate"])
        assert shown(row[4], p["evicted_blocks"])


def test_serving_replay_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = replay(tmp_path, "--blocks", "48", "--mode", "serving")
    run = load_run(run_dir)
    assert run.report["serving"] is not None
    assert [c for c in consistency_checks(run) if not c.ok] == []
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    expected = expected_figures(run_dir)
    _check(terminal_rows(capsys.readouterr().out), expected, "terminal")
    _check(html_rows((run_dir / "report.html").read_text()), expected, "html")
