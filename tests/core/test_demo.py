import subprocess
import sys
from pathlib import Path

from prefixcache.cli import main
from prefixcache.demo import run_demo

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = [
    "max_attention_abs_diff=0.000e+00",
    "unique_blocks=4 allocated_slots=16 unique_live_tokens=13",
    "internal_fragmentation_slots=3 prefix_sharing_saved_slots=4",
]


def test_worked_example_figures():
    r = run_demo()
    assert r.max_attention_abs_diff == 0.0
    assert (r.unique_blocks, r.allocated_slots, r.unique_live_tokens) == (4, 16, 13)
    assert (r.internal_fragmentation_slots, r.prefix_sharing_saved_slots) == (3, 4)
    a, b = r.block_tables
    assert len(a) == 3 and len(b) == 2 and a[0] == b[0] and len(set(a + b)) == 4


def test_cli_demo_prints_seed_format(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for line in EXPECTED:
        assert line in out


def run_example(name: str) -> str:
    cmd = [sys.executable, str(ROOT / "examples" / name)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def test_example_script_runs():
    out = run_example("paged_attention_reference.py")
    for line in EXPECTED:
        assert line in out


def test_embedding_example_runs():
    out = run_example("embedding.py")
    assert "computed_prefill_tokens=" in out and "active=0" in out
