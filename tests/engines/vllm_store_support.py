"""What the store connector's tests need from vLLM's virtualenv: whether it can run the
connector, and an import path that gives its processes this checkout's ``prefixcache`` (and
nothing else of the checkout: its top-level ``kernels/`` folder would shadow a package vLLM's
dependencies import).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from prefixcache.engines.vllm.install import MAKE_TARGET, VLLMInstall, find_vllm
from prefixcache.engines.vllm.install import vllm_missing_reason as _vllm_missing

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR_NEEDS = ("xxhash", "lmdb", "pytest")  # in vLLM's virtualenv, besides vLLM


def connector_missing_reason(*, pytest_too: bool = False) -> str | None:
    """Why the store connector cannot run in vLLM's virtualenv here (None: it can)."""
    reason = _vllm_missing()
    if reason is not None:
        return reason
    install = find_vllm()
    needs = CONNECTOR_NEEDS if pytest_too else CONNECTOR_NEEDS[:-1]
    probe = (
        "import importlib.util, sys; "
        f"sys.exit(0 if all(importlib.util.find_spec(m) for m in {needs!r}) else 1)"
    )
    done = subprocess.run([str(install.python), "-c", probe], capture_output=True)
    if done.returncode != 0:
        return (
            f"vLLM's virtualenv at {install.env} lacks {', '.join(needs)} (the store connector's "
            f"needs): run `{MAKE_TARGET}`"
        )
    return None


def checkout_import_path(folder: Path) -> Path:
    """A folder holding only a link to this checkout's ``prefixcache`` package, to put on
    ``PYTHONPATH`` for vLLM's processes."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "prefixcache"
    if not link.exists():
        link.symlink_to(ROOT / "prefixcache", target_is_directory=True)
    return folder


def vllm_install() -> VLLMInstall:
    """The ready install (call after ``connector_missing_reason`` returned None)."""
    return find_vllm()
