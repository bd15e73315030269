"""Token-id validation at the edge: everything inside works on little-endian int32 arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixcache.errors import InvalidTokensError

MAX_TOKEN_ID = 2**31 - 1
_INT32 = np.dtype("<i4")

TokenIds = Sequence[int] | np.ndarray | Any  # Any covers torch.Tensor without importing torch


def as_token_array(tokens: TokenIds, *, allow_empty: bool = False) -> np.ndarray:
    """Return ``tokens`` as a contiguous 1-D ``<i4`` array, or raise InvalidTokensError.

    Accepts a list/tuple/range of ints, a numpy integer array or a torch integer tensor.
    """
    if (  # the hot path: what a runtime holds already
        type(tokens) is np.ndarray
        and tokens.dtype == _INT32
        and tokens.ndim == 1
        and tokens.size
        and tokens.flags.c_contiguous
        and np.minimum.reduce(tokens) >= 0
    ):
        return tokens
    if type(tokens).__module__.startswith("torch"):
        tokens = _torch_to_numpy(tokens)
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, (str, bytes)):
            raise InvalidTokensError("token ids must be integers, got a string; tokenize first")
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise InvalidTokensError(
                f"token ids must be a flat sequence of integers: {exc}"
            ) from None
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


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidTokensError(f"unsupported token container {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise InvalidTokensError(f"token ids must be integers, got dtype {tensor.dtype}")
    return tensor.detach().to("cpu").contiguous().numpy()
