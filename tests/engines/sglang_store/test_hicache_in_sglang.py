"""The HiCache backend's tests inside SGLang's own code (``in_sglang/``), started here.

SGLang is not installed anywhere: its published wheel (tests/engine_wheels.py, as the other
tests that run SGLang's code) is unpacked into a temporary folder and put on the path of vLLM's
interpreter, whose virtualenv has torch and what SGLang's host memory pool imports (``make
vllm-env`` adds the rest). This test fails with their output when any of them fails.
"""

from __future__ import annotations

import subprocess
import zipfile

import pytest
from engine_wheels import SGLANG, missing, wheel

from prefixcache.engines.vllm.install import STORE_PACKAGES, engine_environment
from tests.engines.vllm_store.store_support import (
    ROOT,
    checkout_import_path,
    connector_missing_reason,
    vllm_install,
)


def test_hicache_backend_in_sglangs_own_code(tmp_path):
    reason = missing(SGLANG) or connector_missing_reason(also=tuple(STORE_PACKAGES))
    if reason is not None:
        pytest.skip(reason)
    site = tmp_path / "sglang-site"
    path = wheel(SGLANG)
    assert path is not None
    with zipfile.ZipFile(path) as zf:
        zf.extractall(site, [n for n in zf.namelist() if n.startswith("sglang/")])
    install = vllm_install()
    env = engine_environment(
        install.env, PYTHONPATH=f"{site}:{checkout_import_path(tmp_path / 'path')}"
    )
    folder = ROOT / "tests" / "engines" / "sglang_store" / "in_sglang"
    done = subprocess.run(
        [
            str(install.python),
            "-m",
            "pytest",
            str(folder),
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::DeprecationWarning",
            "-W",
            "ignore::UserWarning",
            f"--confcutdir={folder}",
            f"--basetemp={tmp_path / 'runs'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-12000:]
    assert " passed" in output and "skipped" not in output.splitlines()[-1], output[-3000:]
