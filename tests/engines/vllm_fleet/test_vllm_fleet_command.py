"""The one command that puts a real vLLM fleet behind ``prefixcache serve`` on this machine
(``examples/fleet/vllm_fleet.py``, ``make vllm-fleet``): it starts the servers and the service,
the attach probe of each server agrees, a workload through the proxy gets the cached tokens
routing predicted, and every process it started is gone when it exits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _vllm_processes(workdir: Path) -> list[str]:
    """Command lines of live processes that serve from ``workdir``'s logs or config."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm.entrypoints" in cmdline or str(workdir) in cmdline:
            found.append(cmdline)
    return found


def test_one_command_serves_a_real_vllm_fleet(tmp_path: Path) -> None:
    before = set(_vllm_processes(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fleet" / "vllm_fleet.py"), "--replicas", "1",
         "--port", "0", "--requests", "24", "--exit", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(r"vllm-0: http://127\.0\.0\.1:\d+, attach probe agrees", out), out
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/dashboard", out), out
    row = re.search(r"vllm-0\s+(\d+)\s+(\d+)\s+(\d+)", out)
    assert row, out
    requests, predicted, delivered = map(int, row.groups())
    assert requests == 24 and predicted == delivered > 0, out
    assert set(_vllm_processes(tmp_path)) <= before, "a process it started is still running"
