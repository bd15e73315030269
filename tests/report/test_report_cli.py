"""``prefixcache report`` / ``compare`` and ``render_all``: files written, output, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_report_figures import markdown_rows, shown, terminal_rows
from test_report_runs import write_run

from prefixcache.cli import main
from prefixcache.report import MissingDependencyError, render_all


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    a = write_run(base / "a", n=120, seed=1, sweep="none")
    b = write_run(base / "b", n=150, seed=2, serving=False, sweep="none")
    return a, b


def test_report_prints_summary_and_writes_files(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = runs
    html, md = tmp_path / "out" / "r.html", tmp_path / "r.md"
    assert main(["report", str(a), "--html", str(html), "--md", str(md)]) == 0
    out = capsys.readouterr().out
    for title in (
        "Run",
        "Hit rate",
        "Where the misses come from",
        "Savings",
        "Over time",
        "Definitions",
    ):
        assert f"── {title} " in out
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert "## Where the misses come from" in md.read_text()


def test_report_json_and_quiet(runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = runs
    assert main(["report", str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((a / "report.json").read_text())
    assert main(["report", str(a), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["report", str(a), "--no-definitions"]) == 0
    assert "── Definitions" not in capsys.readouterr().out


def test_report_errors_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input exits 2, as replay's does; 1 is kept for a report whose checks fail."""
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "prefixcache report: error:" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "nowhere"), str(tmp_path / "nowhere")]) == 2
    assert "prefixcache compare: error:" in capsys.readouterr().err
    run = write_run(tmp_path / "bad", n=20, sweep="none")
    report = json.loads((run / "report.json").read_text())
    report["token_hit_rate"] = 2
    (run / "report.json").write_text(json.dumps(report))
    assert main(["report", str(run)]) == 2
    assert "$.token_hit_rate: 2 > maximum 1" in capsys.readouterr().err


def test_compare_shows_setup_and_deltas(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    md = tmp_path / "cmp.md"
    assert main(["compare", str(a), str(b), "--md", str(md)]) == 0
    rows = terminal_rows(capsys.readouterr().out)
    ra, rb = (json.loads((r / "report.json").read_text()) for r in (a, b))
    assert rows["config.mode"][0] == ["serving", "sequential"]
    cells = rows["Token hit rate"][0]
    assert shown(cells[0], ra["token_hit_rate"]) and shown(cells[1], rb["token_hit_rate"])
    assert shown(cells[2], rb["token_hit_rate"] - ra["token_hit_rate"])  # in pp
    hits = rows["Hit tokens"][0]
    assert shown(hits[2], rb["hit_tokens"] - ra["hit_tokens"])
    assert shown(hits[3], (rb["hit_tokens"] - ra["hit_tokens"]) / ra["hit_tokens"])
    assert rows["TTFT p50 (estimate)"][0][1:3] == ["n/a", "n/a"]  # B has no serving figures
    assert markdown_rows(md.read_text())["Hit tokens"][0] == hits


def test_compare_run_with_itself(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = runs
    assert main(["compare", str(a), str(a), "--no-definitions"]) == 0
    out = capsys.readouterr().out
    assert "Same workload and configuration." in out
    assert terminal_rows(out)["Token hit rate"][0][2] == "+0.00 pp"


def test_render_all_writes_into_the_run_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", n=60, sweep="none")
    paths = render_all(run)
    assert paths == {"md": run / "report.md", "html": run / "report.html"}
    assert all(p.stat().st_size > 0 for p in paths.values())


def test_html_without_matplotlib_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run", n=30, sweep="none")
    for name in [m for m in sys.modules if m.startswith("matplotlib")] + [
        "prefixcache.report.render.plots",
    ]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'prefixcache\[report\]'"):
        render_all(run)
    assert (run / "report.md").is_file() and not (run / "report.html").exists()
    assert render_all(run, html=False) == {"md": run / "report.md"}


def test_package_import_does_not_load_matplotlib() -> None:
    code = "import sys, prefixcache.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_without_requests_still_renders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "empty", n=5, serving=False, model=False, sweep="none")
    report = json.loads((run / "report.json").read_text())
    zero = (
        "requests",
        "prompt_tokens",
        "hit_tokens",
        "prompt_blocks",
        "hit_blocks",
        "zero_hit_requests",
        "output_tokens",
        "evicted_blocks",
    )
    report |= dict.fromkeys(zero, 0) | {
        "token_hit_rate": 0.0,
        "block_hit_rate": 0.0,
        "top_prefixes": [],
    }
    report["misses"] = dict.fromkeys(report["misses"], 0)
    report["savings"]["prefill_tokens_saved"] = 0
    (run / "report.json").write_text(json.dumps(report))
    for name in ("requests.csv", "timeline.csv"):
        header = (run / name).read_text().splitlines()[0]
        (run / name).write_text(header + "\n")
    assert main(["report", str(run), "--html", str(tmp_path / "e.html")]) == 0
    out = capsys.readouterr().out
    assert "The timeline is empty." in out and "No prefix was shared." in out
    passed, total = re.findall(r"\d+", terminal_rows(out)["Consistency checks"][0][0])
    assert passed == total


def _edit_sweep(run: Path, edit: Callable[[list[dict[str, Any]]], None]) -> Path:
    report = json.loads((run / "report.json").read_text())
    edit(report["sweep"])
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_compare_sweeps_point_by_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def with_misses(points: list[dict[str, Any]], capacity_miss: int) -> None:
        for p in points:
            p["prompt_tokens"] = 10_000
            p["misses"] = {"cold": 500, "capacity": capacity_miss, "isolation": 0}
            p["misses"] |= {"tail": 0, "routing": 0}

    def edit_b(points: list[dict[str, Any]]) -> None:
        with_misses(points, 1_000)
        points[:] = [p for p in points if p["capacity_blocks"] != 4096]
        points.append(dict(points[-1], capacity_blocks=8192))
        next(p for p in points if p["capacity_blocks"] == 256)["token_hit_rate"] = 0.5

    a = _edit_sweep(write_run(tmp_path / "a", n=40, seed=1), lambda ps: with_misses(ps, 2_000))
    b = _edit_sweep(write_run(tmp_path / "b", n=40, seed=2), edit_b)
    md = tmp_path / "cmp.md"
    assert main(["compare", str(a), str(b), "--no-definitions", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert "── Sweep points: 7 of A's 8 match B's 8" in out
    rows = markdown_rows(md.read_text())
    point_a = next(
        p
        for p in json.loads((a / "report.json").read_text())["sweep"]
        if p["capacity_blocks"] == 256
    )
    cells = rows["256"][0]  # block size, policy, then A, B, Δ per figure
    assert shown(cells[2], point_a["token_hit_rate"]) and shown(cells[3], 0.5)
    assert shown(cells[4], 0.5 - point_a["token_hit_rate"])
    assert cells[5:8] == ["20.00%", "10.00%", "-10.00 pp"]  # capacity misses
    assert cells[8:11] == ["5.00%", "5.00%", "+0.00 pp"]  # cold misses
    assert "4,096" not in rows and "8,192" not in rows
    assert "Only in A (1): 4,096 blocks" in out and "Only in B (1): 8,192 blocks" in out


def test_compare_sweep_with_a_single_run(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep_run = write_run(tmp_path / "sweep", n=40, seed=1)
    single, _ = runs
    md = tmp_path / "cmp.md"
    assert main(["compare", str(sweep_run), str(single), "--no-definitions", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert "── Sweep points: 1 of A's 8 match B's 1" in out
    rb = json.loads((single / "report.json").read_text())
    assert shown(markdown_rows(md.read_text())["512"][0][3], rb["token_hit_rate"])
    assert "Only in A (7): 32 blocks" in out and "Only in B" not in out
    assert "the sweep points are compared below" in md.read_text()


def test_an_unbounded_cache_reads_unbounded_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # it read 9,223,372,036,854,775,807 blocks (and 17592186044416.00 TiB) in sweep rows, free
    # blocks and the sparkline scales
    import yaml

    spec = yaml.safe_load(Path("scenarios/shared_system_prompt.yaml").read_text())
    spec["requests"] = 200
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(spec))
    out, md = tmp_path / "run", tmp_path / "r.md"
    args = ["replay", str(scenario), "--blocks", "100,inf", "--model", "llama-3.1-8b"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    assert main(["report", str(out), "--md", str(md)]) == 0
    single = tmp_path / "single"
    assert (
        main(["replay", str(scenario), "--blocks", "inf", "--out", str(single), "--no-progress"])
        == 0
    )
    assert main(["report", str(single)]) == 0
    # a fleet sweep's summary and a compare of two runs printed the raw number
    fleet = tmp_path / "fleet"
    args = ["replay", str(scenario), "--blocks", "inf,100", "--mode", "serving"]
    assert main([*args, "--replicas", "2", "--out", str(fleet), "--no-progress"]) == 0
    assert main(["compare", str(single), str(out)]) == 0
    text = capsys.readouterr().out + md.read_text() + (out / "report.html").read_text()
    assert "unbounded" in text
    for huge in ("9,223,372", "9223372", "17592186044416", "17,592,186"):
        assert huge not in text, huge


CHAT_SMALL = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"


def _replay_chat(out: Path, *args: str) -> Path:
    argv = ["replay", str(CHAT_SMALL), "--model", "llama-3.1-8b", "--jobs", "1"]
    assert main([*argv, *args, "--out", str(out), "--no-progress"]) == 0
    return out


def test_compare_shows_tier_settings_one_per_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _replay_chat(tmp_path / "plain", "--blocks", "200")
    tiered = _replay_chat(tmp_path / "tiered", "--blocks", "200", "--host-memory", "1GiB")
    capsys.readouterr()
    assert main(["compare", str(plain), str(tiered), "--no-definitions"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out
    table = out[out.index("What differs") : out.index("Figures")]
    assert max(len(line) for line in table.splitlines()) <= 100
    rows = terminal_rows(out)
    assert rows["config.tiers.host_bytes"][0] == ["n/a", "1.00 GiB"]
    assert rows["config.tiers.host_blocks"][0] == ["n/a", "512"]
    assert rows["config.tiers.host_bandwidth_bytes_per_s"][0] == ["n/a", "55.0 GB/s"]


def test_compare_matches_sweeps_that_differ_in_one_setting_throughout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two capacity sweeps with different pool sizes: the points match by capacity, and the
    pool size is named as what differs throughout."""
    sweep = ("--blocks", "100,200,400")
    a = _replay_chat(tmp_path / "a", *sweep, "--pool-memory", "1GiB")
    b = _replay_chat(tmp_path / "b", *sweep, "--pool-memory", "2GiB")
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--no-definitions"]) == 0
    out = capsys.readouterr().out
    assert "── Sweep points: 3 of A's 3 match B's 3" in out
    assert "Matched without pool blocks: 512 in every point of A, 1,024 in every point of B" in (
        " ".join(out.split())
    )
    assert "Only in" not in out
    # points that differ in what a sweep varies are still told apart
    c = _replay_chat(tmp_path / "c", "--blocks", "200,800", "--pool-memory", "2GiB")
    capsys.readouterr()
    assert main(["compare", str(a), str(c), "--no-definitions"]) == 0
    out = capsys.readouterr().out
    assert "── Sweep points: 1 of A's 3 match B's 2" in out
    assert "Only in B (1): 800 blocks" in out


def test_compare_tells_pool_write_policies_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two sweeps that differ only in when blocks enter the pool: the points match by capacity
    and the write policy is named as what differs throughout, in the setup and the sweep."""
    sweep = ("--blocks", "100,200", "--pool-memory", "1GiB")
    a = _replay_chat(tmp_path / "a", *sweep, "--pool-write", "evict")
    b = _replay_chat(tmp_path / "b", *sweep, "--pool-write", "through")
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--no-definitions"]) == 0
    out = capsys.readouterr().out
    assert terminal_rows(out)["config.tiers.pool_write"][0] == ["evict", "through"]
    assert "── Sweep points: 2 of A's 2 match B's 2" in out
    assert "Matched without pool write: evict in every point of A, through in every point of B" in (
        " ".join(out.split())
    )
    # the same policy on both sides: the column says which
    capsys.readouterr()
    assert main(["compare", str(b), str(b), "--no-definitions"]) == 0
    assert "Pool write" in capsys.readouterr().out
