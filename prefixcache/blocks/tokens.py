"""Validation at the edge: token ids become little-endian int32 arrays, sizes become plain ints."""

from __future__ import annotations

import operator
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import numpy as np

from prefixcache.errors import InvalidArgumentError, InvalidTokensError

MAX_TOKEN_ID: Final = 2**31 - 1
_INT32 = np.dtype("<i4")

# Any covers torch.Tensor without importing torch
TokenIds: TypeAlias = Sequence[int] | np.ndarray | Any

# In C, built with the compiled core (None while the Python sources are in charge): a list of
# plain ints straight to bytes, about a fifth of struct's cost per token; and the range check of
# an int32 array's bytes, without the fixed cost of a numpy reduction (most of a short prompt's)
_pack_plain_ints: Callable[[list[Any]], bytes | None] | None
_nonnegative: Callable[[bytes], bool] | None
try:
    from prefixcache.blocks._token_pack import int32_nonnegative, pack_token_list

    _pack_plain_ints, _nonnegative = pack_token_list, int32_nonnegative
except ImportError:
    _pack_plain_ints = _nonnegative = None


def as_token_array(tokens: TokenIds, *, allow_empty: bool = False) -> np.ndarray:
    """Return ``tokens`` as a contiguous 1-D ``<i4`` array, or raise InvalidTokensError.

    Accepts a list/tuple/range of ints, a numpy integer array or a torch integer tensor. Bools,
    floats, negative ids and ids of 2**31 or more are rejected.
    """
    cls = type(tokens)
    if (  # the hot path: what a runtime holds already
        isinstance(tokens, np.ndarray)
        and cls is np.ndarray
        and tokens.dtype == _INT32
        and tokens.ndim == 1
        and tokens.size
        and tokens.flags.c_contiguous
        and np.minimum.reduce(tokens) >= 0
    ):
        return tokens
    if isinstance(tokens, list) and cls is list and tokens:
        packed = _pack_list(tokens)
        if packed is not None:
            return np.frombuffer(bytearray(packed), dtype=_INT32)
    if cls.__module__.startswith("torch"):
        tokens = _torch_to_numpy(tokens)
    if isinstance(tokens, np.ma.MaskedArray):
        raise InvalidTokensError("token ids must not be a masked array; fill or compress it first")
    if isinstance(tokens, np.ndarray):
        arr = np.asarray(tokens)  # a subclass could override min/max
    else:
        if isinstance(tokens, (str, bytes, bytearray)):
            raise InvalidTokensError("token ids must be integers, got a string; tokenize first")
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError, RuntimeError) as exc:  # Runtime: tensors needing grad
            raise InvalidTokensError(
                f"token ids must be a flat sequence of integers: {exc}"
            ) from None
        if arr.dtype == object or (
            arr.dtype.kind in "iu" and isinstance(tokens, list | tuple) and _has_bool(tokens)
        ):
            raise InvalidTokensError("token ids must be integers, got a bool or another object")
    if arr.ndim != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return np.zeros(0, dtype="<i4")
        raise InvalidTokensError("token ids are empty; a request needs at least one token")
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise InvalidTokensError(f"token ids must be >= 0 (valid: [0, 2**31)), got {lo}")
    if hi > MAX_TOKEN_ID:
        raise InvalidTokensError(f"token ids must be < 2**31 (valid: [0, 2**31)), got {hi}")
    return np.ascontiguousarray(arr, dtype=_INT32)


def as_token_bytes(tokens: TokenIds) -> bytes:
    """``as_token_array(tokens).tobytes()`` (the int32 LE token bytes), without the array
    round trip for the containers a runtime holds: an int32 array or a list of ints."""
    cls = type(tokens)
    if (  # an int32 array (its dtype the interned one): its bytes, checked in one pass
        cls is np.ndarray
        and isinstance(tokens, np.ndarray)
        and _nonnegative is not None
        and tokens.dtype is _INT32
        and tokens.ndim == 1
        and tokens.size
    ):
        data: bytes = tokens.tobytes()
        if _nonnegative(data):
            return data
    elif cls is list and isinstance(tokens, list) and tokens:
        packed = _pack_list(tokens)
        if packed is not None:
            return packed
    return as_token_array(tokens).tobytes()  # an int32 array comes back as it is


_NATIVE_INT32 = sys.byteorder == "little" and struct.calcsize("i") == 4


def token_list(data: bytes | bytearray) -> list[int]:
    """The token ids of int32 LE bytes as a list of ints (an event's ``token_ids``): read in
    place where the machine's own ints are int32 LE, else through numpy."""
    if _NATIVE_INT32:
        return memoryview(data).cast("i").tolist()
    return np.frombuffer(data, dtype=_INT32).tolist()


def checked_token_bytes(data: object) -> bytes:
    """``data`` if it is int32 LE token ids, as ``as_token_bytes`` returns them (``bytes``, at
    least one id, each in [0, 2**31)); else InvalidTokensError."""
    if type(data) is not bytes:
        raise InvalidTokensError(
            f"token bytes must be bytes, got {type(data).__name__}: pass int32 little-endian "
            "bytes (numpy: arr.astype('<i4').tobytes()), or use append() for other containers"
        )
    if not data:
        raise InvalidTokensError("token ids are empty; a request needs at least one token")
    if len(data) % 4:
        raise InvalidTokensError(
            f"token bytes hold whole int32 ids (4 bytes each); got {len(data)} bytes"
        )
    if _nonnegative is not None:
        ok = _nonnegative(data)
    else:
        ok = int(np.frombuffer(data, dtype=_INT32).min()) >= 0
    if not ok:
        raise InvalidTokensError("token ids must be >= 0 (valid: [0, 2**31))")
    return data


_BOOL_DTYPES = ("bool", "torch.bool")  # 0-d arrays and tensors in a list (list(tensor))


def _pack_list(tokens: list[Any]) -> bytes | None:
    """A list of integers straight to int32 LE bytes, or None for the general path (which says
    what is wrong with anything else).

    ``struct`` packs only integers (not floats, strings or numpy bools) within int32's range;
    a bool packs as 0 or 1, so only those values need their type looked at. The C helper takes
    the common case first: every item a plain int in range.
    """
    if _pack_plain_ints is not None:
        fast = _pack_plain_ints(tokens)
        if fast is not None:
            return fast
    try:
        packed = struct.pack(f"<{len(tokens)}i", *tokens)
    except TypeError:  # an object whose __index__ refuses (a float array or tensor)
        return None
    except struct.error:
        if all(type(t) is int for t in tokens):  # plain ints, one of them out of range
            hi, lo = max(tokens), min(tokens)
            bad = hi if hi > MAX_TOKEN_ID else lo
            raise InvalidTokensError(
                f"token ids must be < 2**31 (valid: [0, 2**31)), got {bad}"
                if bad > 0
                else f"token ids must be >= 0 (valid: [0, 2**31)), got {bad}"
            ) from None
        return None
    arr = np.frombuffer(packed, dtype=_INT32)
    lo = int(np.minimum.reduce(arr))
    if lo < 0:
        raise InvalidTokensError(f"token ids must be >= 0 (valid: [0, 2**31)), got {lo}")
    if lo <= 1:  # bools pack as 0 or 1: only those values need their type looked at
        for i in np.flatnonzero(arr <= 1).tolist():
            t = tokens[i]  # a bool, or a 0-d bool array or tensor (list(tensor) gives those)
            if type(t) is bool or str(getattr(t, "dtype", "")) in _BOOL_DTYPES:
                raise InvalidTokensError(f"token ids must be integers, got {t!r} at {i}")
    return packed


def _has_bool(tokens: list[Any] | tuple[Any, ...]) -> bool:
    return any(
        type(t) is bool or type(t) is np.bool_ or str(getattr(t, "dtype", "")) in _BOOL_DTYPES
        for t in tokens
    )


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidTokensError(f"unsupported token container {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise InvalidTokensError(f"token ids must be integers, got dtype {tensor.dtype}")
    return tensor.detach().to("cpu").contiguous().numpy()


def as_single_token(value: Any) -> int | None:
    """``value`` as one token id if it is a scalar integer (int, numpy integer, 0-d array or
    tensor, as ``argmax`` returns), else None. Raises InvalidTokensError for a scalar out of
    range or of the wrong type."""
    cls = type(value)
    if cls is int:
        token = value
    elif cls is bool or cls is np.bool_:
        raise InvalidTokensError(f"token ids must be integers, got {value!r}")
    elif isinstance(value, np.integer):
        token = int(value)
    elif isinstance(value, float | np.floating):
        raise InvalidTokensError(f"token ids must be integers, got {value!r}")
    elif getattr(value, "ndim", None) == 0:  # a 0-d numpy array or torch tensor
        arr = as_token_array(value.reshape(1))
        return int(arr[0])
    else:
        return None
    if not 0 <= token <= MAX_TOKEN_ID:
        raise InvalidTokensError(f"token ids must be in [0, 2**31), got {token}")
    return token


def as_size(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as a plain int >= ``minimum`` (ints, numpy integers, 0-d integer tensors; not
    bools), or raise InvalidArgumentError naming the argument."""
    if isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {number}")
    return number
