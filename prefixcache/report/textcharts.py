"""Charts drawn with characters, for the terminal and Markdown reports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SPARK = "▁▂▃▄▅▆▇█"


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    width: int = 40,
    value_text: Sequence[str] | None = None,
) -> list[str]:
    """One horizontal bar per label, scaled to the largest value."""
    top = max(values, default=0) or 1
    pad = max((len(s) for s in labels), default=0)
    texts = value_text if value_text is not None else [f"{v:g}" for v in values]
    return [
        f"{lab:>{pad}} │{'█' * round(width * v / top):<{width}} {txt}"
        for lab, v, txt in zip(labels, values, texts, strict=True)
    ]


def sparkline(values: np.ndarray, width: int = 60, lo: float = 0.0, hi: float = 1.0) -> str:
    """``values`` averaged into ``width`` buckets, each drawn as one of eight heights."""
    if len(values) == 0:
        return ""
    chunks = np.array_split(np.asarray(values, dtype=np.float64), min(width, len(values)))
    means = np.array([c.mean() for c in chunks])
    scaled = np.clip((means - lo) / (hi - lo or 1), 0, 1)
    return "".join(SPARK[round(float(v) * (len(SPARK) - 1))] for v in scaled)
