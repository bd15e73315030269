"""The README's embedding snippet, run as a user runs it: a fresh interpreter from the repository
root, on the CPU (the torch reference kernels: no GPU, no Triton interpreter), within a memory
budget a laptop has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Embedding it in a runtime"
MAX_RSS_BYTES = 1 << 30  # 1 GiB

# Runs the snippet, then reports the process's own peak RSS on its last line, so the figure is
# the snippet's and nothing else's. On Linux that is VmHWM from /proc (kB): ru_maxrss survives
# exec, so a child of a pytest process that had grown past 1 GiB would report the parent's peak.
WRAPPER = """\
import resource, sys
source = sys.stdin.read()
exec(compile(source, "README.md", "exec"), {"__name__": "__main__"})
if sys.platform == "darwin":
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes there
else:
    status = open("/proc/self/status").read().split("VmHWM:", 1)[1]
    rss = int(status.split()[0]) * 1024
print("max-rss-bytes", rss)
"""


def embedding_snippet(readme: str) -> str:
    """The first ```python block of the section under HEADING (up to the next ``## ``)."""
    assert HEADING in readme, f"README.md has no {HEADING!r} section"
    section = readme.split(HEADING, 1)[1].split("\n## ", 1)[0]
    assert "```python\n" in section, f"the {HEADING!r} section has no ```python block"
    return section.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def test_embedding_snippet_runs_on_cpu_in_under_1_gib() -> None:
    snippet = embedding_snippet((ROOT / "README.md").read_text(encoding="utf-8"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, as on a laptop, even on a GPU machine
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER],
        input=snippet,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "req-0: 0 of 220 prompt tokens cached", proc.stdout
    assert lines[1] == "req-1: 200 of 204 prompt tokens cached", proc.stdout
    assert lines[2].startswith("attention out (224, 4, 64), dropped ['req-1']"), proc.stdout
    assert "active=0" in lines[2], proc.stdout  # every block is free or cached at the end
    name, rss = lines[-1].split()
    assert name == "max-rss-bytes"
    assert int(rss) < MAX_RSS_BYTES, f"the snippet peaked at {int(rss) / 2**20:.0f} MiB"
