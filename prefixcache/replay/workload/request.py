"""One replayed request, as every workload source yields it."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prefixcache.blocks.namespace import Namespace


class Request(NamedTuple):
    arrival_s: float
    tokens: np.ndarray  # prompt token ids, contiguous little-endian int32
    output_len: int  # tokens generated per sample
    namespace: Namespace
    n: int = 1  # parallel samples (forks sharing the prompt)
    # The first sample's output when a later request reuses it (multi-turn context); the engines
    # then write exactly these tokens, so the next turn can hit them. None: outputs are not reused.
    output_tokens: np.ndarray | None = None
