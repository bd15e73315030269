"""The README's main command (``make quickstart``), as a user runs it on a fresh checkout."""

import json
import shlex
from pathlib import Path

from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[2]


def quickstart_arguments() -> list[str]:
    """The Makefile's quickstart recipe, as ``prefixcache`` arguments."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nquickstart:", 1)[1].split("\n\n", 1)[0].split("\n", 1)[1]
    words = shlex.split(recipe.replace("\\\n", " "))
    assert words[:3] == ["$(PYTHON)", "-m", "prefixcache"], words
    return words[3:]


def test_readme_main_command_writes_a_complete_report(tmp_path, capsys):
    assert "make quickstart" in (ROOT / "README.md").read_text().split("```", 2)[1]
    args = quickstart_arguments()
    out = tmp_path / "quickstart"
    args[args.index("--out") + 1] = str(out)
    assert main([*args, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "token hit rate" in printed and str(out) in printed
    assert "GPU-seconds" in printed and "of K/V not recomputed" in printed
    for name in ("report.json", "requests.csv", "timeline.csv", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] > 0 and 0.5 < report["token_hit_rate"] <= 1.0
    assert report["token_hit_rate"] <= report["upper_bound_token_hit_rate"] + 1e-12
    # the savings a planner came for, none of them n/a, with their assumptions said once
    savings = report["savings"]
    basis = savings["estimate_basis"]
    assert basis["model"] == "llama-3.1-8b" and basis["gpu"] == "h100-sxm"
    per_token = basis["kv_bytes_per_token"]
    assert per_token == 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
    assert savings["kv_bytes_not_recomputed"] == report["hit_tokens"] * per_token
    assert savings["gpu_seconds_saved_estimate"] == (
        savings["flops_saved_estimate"] / (basis["peak_flops"] * basis["compute_efficiency"])
    )
    markdown = (out / "report.md").read_text()
    savings_md = markdown.split("## Savings", 1)[1].split("\n## ", 1)[0]
    assert "n/a" not in savings_md
    assert "GPU time saved" in savings_md and "KV bytes not recomputed" in savings_md
    assert markdown.count("Estimates assume llama-3.1-8b") == 1
