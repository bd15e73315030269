"""One replayed request, as every workload source yields it."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prefixcache.blocks.namespace import Namespace


class Request(NamedTuple):
    """A request to replay: when it arrives, its prompt, how much it generates and in which
    namespace. ``output_tokens`` is None unless a later turn reuses its output."""

    arrival_s: float  # seconds on the workload's clock (a trace's may count from an epoch)
    tokens: np.ndarray  # prompt token ids, contiguous little-endian int32
    output_len: int  # tokens generated per sample
    namespace: Namespace
    n: int = 1  # parallel samples (forks sharing the prompt)
    # The first sample's output when a later request reuses it (multi-turn context); the engines
    # then write exactly these tokens, so the next turn can hit them. None: outputs are not reused.
    output_tokens: np.ndarray | None = None
