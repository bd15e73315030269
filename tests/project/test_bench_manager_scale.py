"""The manager benchmark's scale mode: it reports the cost per request while the pool fills and
once it is full, and the same requests on a pool that never fills."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scale_mode_splits_the_run_where_the_pool_first_evicts() -> None:
    out = _scale("--requests", "300", "--blocks", "2500")
    filling = re.search(r"filling\s+([\d.]+)\s+us/request \(requests 0-(\d+)\)", out)
    full = re.search(r"full\s+([\d.]+)\s+us/request \(requests (\d+)-299, ([\d,]+) blocks", out)
    assert filling and full, out
    assert int(full.group(2)) == int(filling.group(2)) + 1  # the first request that evicted
    assert int(full.group(3).replace(",", "")) > 0
    assert re.search(r"full / filling\s+[\d.]+", out) and "never full" in out
    assert re.search(r"per 1k tokens\s+[\d.]+ / [\d.]+ us filling / full", out)


def test_scale_mode_says_so_when_the_pool_never_fills() -> None:
    assert "the pool never filled" in _scale("--requests", "20", "--blocks", "100000")


def _scale(*args: str) -> str:
    """What ``bench/manager_loop.py --scale ARGS`` prints."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "manager_loop.py"), "--scale", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return done.stdout
