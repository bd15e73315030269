"""The GPU benchmark script runs end to end: every part with tiny shapes on the CPU (``--smoke``),
so a run on a GPU measures rather than fixes the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_gpu.py"
# Triton 3.6's interpreter holds loaded scalars as 1-element arrays, which NumPy >= 2.4 no longer
# converts to Python ints, so no kernel loop with a loaded bound runs under it (3.9's does).
OLD_INTERPRETER = "only 0-dimensional arrays can be converted to Python scalars"


def test_every_part_of_the_gpu_benchmark_runs_on_tiny_shapes() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=600
    )
    if done.returncode and OLD_INTERPRETER in done.stderr:
        pytest.skip("this Triton's interpreter cannot run kernel loops under this NumPy")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for part in (
        "== decode:",
        "== shared prefix:",
        "== decode launch overhead",
        "== extend (prefill over cached K/V)",
        "extend configs on",
        "== fp8 K/V decode",
        "== store_kv",
        "== KV splits",
        "== decode configs",
        "== store_kv configs",
    ):
        assert part in out, part
    assert "SDPA not run" not in out  # the extend comparison ran, with its causal alignment
    # the kernel agrees with SDPA on every part that compares them (float32 on the CPU)
    extend_rows = out.split("== extend")[1].split("extend configs")[0].splitlines()[2:]
    assert extend_rows and all(float(row.split()[8]) < 1e-4 for row in extend_rows if row)
