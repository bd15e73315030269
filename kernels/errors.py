"""Typed errors raised by the kernel wrappers when their inputs are wrong.

All are ``PrefixCacheError``s; value problems are also ``ValueError`` and dtype problems
``TypeError``, so callers that only know the builtin exceptions still catch them. Every message
names the argument and how to fix it.
"""

from __future__ import annotations

from prefixcache.errors import PrefixCacheError


class KernelInputError(PrefixCacheError, ValueError):
    """Base class for invalid arguments passed to a kernel wrapper."""


class ShapeMismatchError(KernelInputError):
    """A tensor has the wrong rank or a dimension that disagrees with another argument."""


class UnsupportedConfigError(KernelInputError):
    """A head dim, block size, layout or launch config that the kernels do not support."""


class DeviceMismatchError(KernelInputError):
    """The tensors of one call live on different devices."""


class SequenceLayoutError(KernelInputError):
    """``seq_lens`` / ``query_start_loc`` / ``slot_mapping`` describe an impossible batch."""


class BlockTableError(KernelInputError):
    """A block table is too short or holds a physical block id outside the cache."""


class KernelDTypeError(PrefixCacheError, TypeError):
    """A tensor has a dtype the kernels do not accept (or one that disagrees with the others)."""


class TritonUnavailableError(PrefixCacheError, RuntimeError):
    """The Triton backend was requested but cannot run here."""
