"""examples/tiny_runtime.py: prefix caching changes the work done, never the tokens or logits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from prefixcache.kernels import interpreter_enabled, triton_available

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_runtime.py"
DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"


@pytest.fixture(scope="module")
def runtime() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_runtime", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _check(runtime: ModuleType, **kw: object) -> None:
    cached, plain, diff = runtime.compare(device=DEVICE, **kw)
    assert cached.tokens == plain.tokens
    assert diff <= runtime.LOGIT_TOL
    assert plain.computed_prompt_tokens == plain.prompt_tokens
    # Every prompt after the first reuses at least the system prompt's full blocks.
    num_prompts = len(cached.tokens)
    assert cached.computed_prompt_tokens <= plain.prompt_tokens - (num_prompts - 1) * 32


def test_torch_reference_path(runtime: ModuleType) -> None:
    _check(runtime, backend="torch")


@pytest.mark.skipif(
    not triton_available() or (DEVICE == "cpu" and not interpreter_enabled()),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)
def test_triton_kernels_path(runtime: ModuleType) -> None:
    _check(runtime, backend="triton", num_prompts=3, max_new_tokens=5)


def _run_script(*args: str) -> str:
    """The example's stdout, run as a script with the torch backend (it must succeed)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "torch", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_runs_as_a_script() -> None:
    assert "generated tokens identical: True" in _run_script()


def test_host_tier_keeps_logits_and_computes_less(runtime: ModuleType) -> None:
    tiered, gpu_only, plain, diff = runtime.compare_host_tier(
        host_blocks=32, num_prompts=6, max_new_tokens=3, backend="torch", device=DEVICE
    )
    assert tiered.tokens == gpu_only.tokens == plain.tokens
    assert diff <= runtime.LOGIT_TOL
    # the GPU pool alone loses the rotating system prompts; the host tier brings them back
    assert tiered.computed_prompt_tokens < gpu_only.computed_prompt_tokens
    assert gpu_only.computed_prompt_tokens <= plain.computed_prompt_tokens


def test_host_tier_runs_as_a_script() -> None:
    stdout = _run_script("--host-blocks", "32")
    assert "generated tokens identical: True" in stdout
    assert "with a host tier of 32 blocks" in stdout
