"""The README's main command, as a user runs it on a fresh checkout."""

import json
from pathlib import Path

from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_readme_embedding_snippet_runs_as_written() -> None:
    """The README's first Python block runs on this machine (CPU here, CUDA where there is
    one) and leaves the cache consistent."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = readme.split("## Embedding it in a runtime", 1)[1].split("```python\n", 1)[1]
    snippet = snippet.split("```", 1)[0]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    mgr = scope["mgr"]
    mgr.check_integrity()
    assert scope["dropped"] == ["req-1"] and mgr.requests == []
    assert scope["tables"].shape[0] == 2 and scope["res"].slots
