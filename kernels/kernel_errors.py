"""Typed errors raised by the kernel wrappers when their inputs are wrong or cannot run here.

All are ``PrefixCacheError``s. Callers tell apart a bad argument (``KernelInputError``, also a
``ValueError``), a bad dtype (``KernelDTypeError``, also a ``TypeError``), an argument the
kernels do not support although it is valid (``UnsupportedConfigError``, a ``KernelInputError``)
and a missing Triton (``TritonUnavailableError``). Every message names the argument and how to
fix it.
"""

from __future__ import annotations

from prefixcache.errors import PrefixCacheError


class KernelInputError(PrefixCacheError, ValueError):
    """An argument of a kernel wrapper is wrong: a shape, device, sequence layout or block id."""


class UnsupportedConfigError(KernelInputError):
    """A head dim, block size, layout or launch config that the kernels do not support."""


class KernelDTypeError(PrefixCacheError, TypeError):
    """A tensor has a dtype the kernels do not accept (or one that disagrees with the others)."""


class TritonUnavailableError(PrefixCacheError, RuntimeError):
    """The Triton backend was requested but cannot run here."""
