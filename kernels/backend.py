"""Which implementation runs a call: the Triton kernel (compiled or interpreted) or torch.

Triton is an optional dependency, so nothing here imports it at module import time.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Literal

import torch

from prefixcache.errors import KernelInputError, TritonUnavailableError

Backend = Literal["auto", "triton", "torch"]

_TRUE_VALUES = ("1", "true", "on", "yes")


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is set (parsed the way Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE_VALUES  # no strip: as Triton


@functools.cache
def _warn_torch_fallback_once() -> None:
    warnings.warn(
        "triton is not installed: CUDA tensors fall back to the torch reference attention, "
        "which is much slower. Install the extra with `pip install prefixcache[triton]`.",
        RuntimeWarning,
        stacklevel=4,
    )


def resolve_backend(requested: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """Pick the implementation for tensors on ``device``.

    ``auto``: CUDA runs the compiled Triton kernel; CPU runs the Triton interpreter when
    ``TRITON_INTERPRET`` is enabled and the torch reference otherwise.
    """
    if requested not in ("auto", "triton", "torch"):
        raise KernelInputError(f"backend must be 'auto', 'triton' or 'torch', got {requested!r}")
    if requested == "torch":
        return "torch"
    on_cuda = device.type == "cuda"
    runnable = triton_available() and (on_cuda or interpreter_enabled())
    if requested == "triton" and not runnable:
        if not triton_available():
            raise TritonUnavailableError(
                "backend='triton' needs the triton package: `pip install prefixcache[triton]`"
            )
        raise TritonUnavailableError(
            f"backend='triton' on {device.type} tensors needs a CUDA device, or the Triton "
            "interpreter: set TRITON_INTERPRET=1 before triton is first imported"
        )
    if runnable:
        return "triton"
    if on_cuda:
        _warn_torch_fallback_once()
    return "torch"


def check_kernel_mode(kernel: object, device: torch.device) -> None:
    """Fail clearly if the jitted kernel's mode (compiled/interpreted) cannot run on ``device``.

    ``triton.jit`` decides at import time whether it interprets, so toggling TRITON_INTERPRET after
    the kernel module was imported has no effect.
    """
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise TritonUnavailableError(
            "the Triton kernels were compiled for GPU (TRITON_INTERPRET was unset when they were "
            "imported); CPU tensors need TRITON_INTERPRET=1 set before the first triton import, "
            "or backend='torch'"
        )
