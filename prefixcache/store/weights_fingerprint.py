"""A fingerprint of a model's weights, to name them in a ``Namespace`` (``weights=``).

Two checkpoints served under one model name (a fine-tune, another revision, another
quantization) compute other K/V for the same tokens; a namespace that names the weights keeps
their blocks apart everywhere (the digest is seeded by it, and a store record carries its
fingerprint). A revision string does that when there is one (a Hugging Face commit, vLLM's
``--revision``); otherwise fingerprint the tensors themselves, once at start-up: every name,
dtype, shape and byte goes in (xxh3-128; about as fast as reading the weights once, a second or
two for 16 GB).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash


def weights_fingerprint(tensors: Mapping[str, Any]) -> str:
    """``"xxh3:"`` and 32 hex digits naming ``tensors`` (a ``state_dict``: names to torch
    tensors or numpy arrays), in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        value = tensors[name]
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu()
            dtype, shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        else:
            a = np.ascontiguousarray(value)
            dtype, shape, raw = str(a.dtype), a.shape, a.reshape(-1).view(np.uint8)
        head = f"{name}\x00{dtype}\x00{','.join(map(str, shape))}\x00".encode()
        h.update(len(head).to_bytes(4, "little") + head)
        h.update(raw.data)
    return "xxh3:" + h.hexdigest()
