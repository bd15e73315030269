"""The run directory a replay writes and a report reads: one definition of its file contract.

``report.json`` carries ``schema_version``; ``requests.csv`` has one row per request and
``timeline.csv`` one row per sample, with these columns in this order. The figures both sides
compute (rates, nearest-rank percentiles, miss causes) are defined here once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SCHEMA_VERSION = 1

# The causes of a missed prompt token, as keyed in report.json ``misses`` and requests.csv.
MISS_CAUSES = ("cold", "capacity", "isolation", "tail", "routing")

# The percentiles reported for time to first token and per-request hit ratios.
PERCENTILES = (50, 90, 99)

REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "namespace",
    "prompt_tokens",
    "hit_tokens",
    "prompt_blocks",
    "hit_blocks",
    "miss_cold",
    "miss_capacity",
    "miss_isolation",
    "miss_tail",
    "miss_routing",
    "output_tokens",
    "ttft_s",
    "ttft_nocache_s",
)

TIMELINE_COLUMNS = (
    "t",  # request index in sequential mode, simulated seconds in serving mode
    "blocks_active",
    "blocks_cached",
    "blocks_free",
    "evicted_blocks_cum",
    "prompt_tokens_cum",
    "hit_tokens_cum",
    "rolling_token_hit_rate",
)


def rate(part: float, whole: float) -> float:
    """``part / whole``, or 0.0 when ``whole`` is zero."""
    return part / whole if whole else 0.0


def nearest_rank(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The smallest value with at least ``q`` percent of ``values`` at or below it (NaN when
    there are none)."""
    xs = np.sort(np.asarray(values, dtype=np.float64))
    if len(xs) == 0:
        return math.nan
    return float(xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))])
