"""Ctrl-C in any command ends with one line on stderr (after what the command printed before it)
and exit code 130, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = "scenarios/traces/mooncake_sample.jsonl"

# Runs the command with one function it calls replaced by one that raises KeyboardInterrupt,
# as the interpreter does when Ctrl-C arrives while that function works.
SCRIPT = """
import importlib, sys
from prefixcache.cli import main

def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

module, name = sys.argv[1].rsplit(":", 1)
target = importlib.import_module(module)
if not hasattr(target, name):  # a renamed target would leave the command uninterrupted
    sys.exit(f"no {name} in {module} to interrupt")
setattr(target, name, interrupted)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("target", "argv"),
    [
        ("prefixcache.report.print_cli:load_run", ["report", "runs/x"]),
        ("prefixcache.report.print_cli:load_run", ["compare", "runs/a", "runs/b"]),
        ("prefixcache.replay.analyze:analyze_source", ["analyze", TRACE]),
        (
            "prefixcache.replay.workload.export:mooncake_lines",
            ["export", TRACE, "--format", "mooncake"],
        ),
        (
            "prefixcache.replay.calibrate.decoder_timing:run_bench",
            ["calibrate", "--device", "cpu", "--tiny"],
        ),
        ("prefixcache.demo:run_demo", ["demo", "--device", "cpu"]),
    ],
    ids=["report", "compare", "analyze", "export", "calibrate", "demo"],
)
def test_ctrl_c_exits_130_with_one_line(target: str, argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, target, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    # what the command said before the interrupt (calibrate names what it times), then one line
    *before, last = proc.stderr.strip().splitlines()
    assert last == f"prefixcache {argv[0]}: interrupted"
    assert not any("interrupt" in line for line in before)
