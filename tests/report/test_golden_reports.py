"""Fixed runs whose report.json (and CSV digests) must not change.

The golden files in ``tests/golden/`` were written by ``python tests/test_golden_reports.py``.
Only the fields that vary between runs of the same input are normalized: the replay wall time,
the rate derived from it, and the source path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CHAT = GOLDEN / "chat_small.yaml"

CASES: dict[str, list[str]] = {
    "scenario_sequential": [
        str(ROOT / "scenarios" / "shared_system_prompt.yaml"),
        *("--blocks", "200", "--seed", "7"),
    ],
    "mooncake_trace": [
        str(ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"),
        *("--blocks", "4000"),
    ],
    "serving": [
        str(CHAT),
        *("--mode", "serving", "--model", "llama-3.1-8b", "--gpu", "h100-sxm"),
        *("--blocks", "300", "--token-budget", "1024"),
    ],
    "sweep": [
        str(CHAT),
        *("--blocks", "120,400", "--policy", "lru,lfu", "--block-size", "16,32"),
        *("--model", "llama-3.1-8b", "--jobs", "1"),
    ],
}
DIGESTED = ("requests.csv", "timeline.csv")
RUN_DEPENDENT = ("replay_seconds", "requests_per_second")


def normalized_report(run_dir: Path) -> str:
    report: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    for key in RUN_DEPENDENT:
        report[key] = None
    report["source"]["path"] = Path(report["source"]["path"]).name
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def digests(run_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((run_dir / name).read_bytes()).hexdigest() for name in DIGESTED}


def replay(name: str, out: Path) -> Path:
    run_dir = out / name
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["replay", *CASES[name], "--out", str(run_dir), "--no-progress"])
    assert rc == 0
    return run_dir


@pytest.mark.parametrize("name", sorted(CASES))
def test_report_matches_golden(tmp_path: Path, name: str) -> None:
    run_dir = replay(name, tmp_path)
    assert normalized_report(run_dir) == (GOLDEN / f"{name}.report.json").read_text()
    expected = json.loads((GOLDEN / f"{name}.digests.json").read_text())
    assert digests(run_dir) == expected


def write_golden(out: Path) -> None:
    for name in CASES:
        run_dir = replay(name, out)
        (GOLDEN / f"{name}.report.json").write_text(normalized_report(run_dir))
        digest_text = json.dumps(digests(run_dir), indent=2, sort_keys=True) + "\n"
        (GOLDEN / f"{name}.digests.json").write_text(digest_text)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_golden(Path(tmp))
    sys.exit(0)
