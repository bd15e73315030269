"""Test configuration. The Triton interpreter must be enabled before anything imports triton.

It is enabled only when TRITON_INTERPRET is unset: ``TRITON_INTERPRET=0 pytest tests/kernels`` on a
machine with a CUDA GPU runs the kernel tests compiled, on CUDA tensors (bf16 and CUDA-graph cases
included), as ``bench/gpu_all.sh`` does.

The kernels live outside the package folder and are importable only from an installed package,
so a plain checkout stops here with how to install it.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def _installed() -> bool:
    try:
        return importlib.util.find_spec("prefixcache.kernels") is not None
    except ImportError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    if not _installed():
        pytest.exit(
            "prefixcache is not installed: run `make install` (pip install -e '.[dev]')",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A redis-server on a free port for the module (skipped when redis-server is absent)."""
    from fleet_support import redis_server_fixture

    yield from redis_server_fixture(tmp_path_factory)
