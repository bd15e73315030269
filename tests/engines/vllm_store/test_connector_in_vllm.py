"""The store connector against vLLM's own scheduler, in vLLM's virtualenv.

vLLM is not installed in the project's environment (it pins its own torch, transformers and
numpy), so the tests that import it (``in_vllm/``) run with vLLM's interpreter: this test starts
pytest there over that folder, with this checkout's package on the path, and fails with its
output when any of them fails.
"""

from __future__ import annotations

import subprocess

from store_support import ROOT, checkout_import_path, vllm_install

from prefixcache.engines.vllm.install import engine_environment


def test_connector_units_in_vllms_scheduler(tmp_path):
    install = vllm_install()
    path = checkout_import_path(tmp_path / "path")
    env = engine_environment(
        install.env,
        PYTHONPATH=str(path),
        PREFIXCACHE_VLLM_MODEL=str(install.model),
        VLLM_HOST_IP="127.0.0.1",
    )
    folder = ROOT / "tests" / "engines" / "vllm_store" / "in_vllm"
    done = subprocess.run(
        [
            str(install.python),
            "-m",
            "pytest",
            str(folder),
            "-W",
            "ignore::DeprecationWarning",
            "-p",
            "no:cacheprovider",
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
