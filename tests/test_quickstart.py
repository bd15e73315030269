"""The README's main command, as a user runs it on a fresh checkout."""

import json
from pathlib import Path

from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_main_command_writes_a_report(tmp_path, capsys):
    out = tmp_path / "quickstart"
    scenario = ROOT / "scenarios" / "shared_system_prompt.yaml"
    assert (
        main(["replay", str(scenario), "--blocks", "2048", "--out", str(out), "--no-progress"]) == 0
    )
    printed = capsys.readouterr().out
    assert "token hit rate" in printed and str(out) in printed
    for name in ("report.json", "requests.csv", "timeline.csv", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] > 0 and 0.5 < report["token_hit_rate"] <= 1.0
    assert report["token_hit_rate"] <= report["upper_bound_token_hit_rate"] + 1e-12
