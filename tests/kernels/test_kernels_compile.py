"""The kernels compile for sm_90 (H200) without a GPU, catching what the interpreter does not check.

Runs in a subprocess because ``triton.jit`` chose interpreted mode when this test session imported
triton (TRITON_INTERPRET=1 from conftest).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs triton with its NVIDIA backend (ships ptxas)",
)
def test_all_kernel_variants_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "prefixcache.kernels.compile_check", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  sm_90") >= 10, proc.stdout
