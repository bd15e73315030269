"""bench/store_bandwidth.py says what each option does and leaves no store behind: after a run,
and after Ctrl-C in the middle of one (no traceback, exit 130)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "store_bandwidth.py"


def test_help_names_every_option():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=True
    )
    for option, words in (
        ("--store", "lmdb"),
        ("--blocks", "records"),
        ("--repeats", "median"),
        ("--dir", "/dev/shm"),
    ):  # each option's own entry: "  --dir DIR  what it is", up to the next option
        found = re.search(rf"\n  {option} [A-Z]+(.*?)(?=\n  -|\Z)", done.stdout, re.S)
        assert found, f"{option} is not in --help:\n{done.stdout}"
        assert words in " ".join(found.group(1).split()), f"{option}'s help: {found.group(1)!r}"


def test_a_run_leaves_no_store_behind(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--blocks", "4", "--repeats", "1", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2.00M" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_leaves_no_store_behind(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--blocks", "2000", "--repeats", "50", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        header = proc.stdout.readline()  # printed before the first store is opened
        assert header.startswith("store lmdb"), header
        deadline = time.monotonic() + 120
        while not any(tmp_path.iterdir()) and time.monotonic() < deadline:  # a store is open
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err
    assert list(tmp_path.iterdir()) == []
