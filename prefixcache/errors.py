"""Typed errors. Every rejected call raises one of these and leaves the cache state unchanged."""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error the library raises on purpose."""


class InvalidArgumentError(PrefixCacheError, TypeError, ValueError):
    """A call got an argument of the wrong type or out of range (a size, a namespace, a priority,
    a slot). Also a ``TypeError`` and a ``ValueError``, as the builtin checks would raise."""


class ConfigError(PrefixCacheError, ValueError):
    """A constructor or option got a value it cannot work with."""


class InvalidTokensError(PrefixCacheError, ValueError):
    """Token ids are not a 1-D sequence of integers in [0, 2**31)."""


class UnknownRequestError(PrefixCacheError, KeyError):
    """The request id is not admitted (never was, or was already released)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(PrefixCacheError, ValueError):
    """The request id is already admitted."""


class OutOfBlocksError(PrefixCacheError, RuntimeError):
    """Not enough free or evictable blocks right now; retry after other requests release.
    ``needed`` and ``available`` say by how much (the blocks the call needs, those it found;
    -1 where the raiser does not say)."""

    def __init__(self, message: str, *, needed: int = -1, available: int = -1) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available

    @property
    def shortfall(self) -> int:
        """Blocks missing (at least 1), or 0 when the raiser did not say."""
        if self.needed < 0 or self.available < 0:
            return 0
        return max(1, self.needed - self.available)


class RequestTooLargeError(PrefixCacheError, ValueError):
    """The request needs more blocks than the whole pool has; it can never be admitted."""


class CacheInUseError(PrefixCacheError, RuntimeError):
    """The operation needs an idle cache, but blocks are still referenced."""


class WireFormatError(PrefixCacheError, ValueError):
    """Bytes that are not a KV event message (a payload in no known layout, a bad frame)."""


class FleetCapacityError(PrefixCacheError, RuntimeError):
    """A fleet index or subscriber is at a configured limit (replicas, blocks of one event)."""


class UnknownNamespaceError(PrefixCacheError, LookupError):
    """No replica of the fleet serves the request's model, adapter or namespace."""


class UnknownReplicaError(PrefixCacheError, KeyError):
    """The replica name is not part of the fleet."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown replica"


class PayloadTooLargeError(PrefixCacheError, ValueError):
    """A request body or prompt is larger than the service's configured limit."""


class InvalidRequestBodyError(InvalidArgumentError):
    """A service request body is not JSON, or not the JSON its endpoint takes."""


class MalformedJSONError(InvalidRequestBodyError):
    """A service request body is not JSON at all (HTTP 400)."""


class MissingDependencyError(PrefixCacheError, ImportError):
    """An optional dependency needed for this output is not installed; the message names the
    extra that brings it (``pip install 'prefixcache[report]'``)."""


class NoHealthyReplicaError(PrefixCacheError, RuntimeError):
    """Every replica that serves the request's namespace is marked down (failed requests or
    health probes); retry once one is back, in about ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# ---- kernel wrappers ---------------------------------------------------------------------------
# Callers tell apart a bad argument (``KernelInputError``, also a ``ValueError``), a bad dtype
# (``KernelDTypeError``, also a ``TypeError``), an argument the kernels do not support although it
# is valid (``UnsupportedConfigError``, a ``KernelInputError``) and a missing Triton
# (``TritonUnavailableError``). Every message names the argument and how to fix it.


class KernelInputError(PrefixCacheError, ValueError):
    """An argument of a kernel wrapper is wrong: a shape, device, sequence layout or block id."""


class UnsupportedConfigError(KernelInputError):
    """A head dim, block size, layout or launch config that the kernels do not support."""


class KernelDTypeError(PrefixCacheError, TypeError):
    """A tensor has a dtype the kernels do not accept (or one that disagrees with the others)."""


class TritonUnavailableError(PrefixCacheError, RuntimeError):
    """The Triton backend was requested but cannot run here."""
