"""Figures as text, shared by every report format so a figure reads the same everywhere: numbers,
and charts drawn with characters for the terminal and Markdown."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from prefixcache.blocks.pool import UNBOUNDED

NA = "n/a"


def count(n: float | None) -> str:
    if n is None or math.isnan(n):
        return NA
    return f"{int(n):,}"


def count_f(x: float | None) -> str:
    """A rate or other real number rounded to a whole count, with thousands separators."""
    return NA if x is None else f"{x:,.0f}"


def capacity(blocks: int) -> str:
    """A cache size in blocks; "unbounded" for a cache that never runs out."""
    return "unbounded" if blocks >= UNBOUNDED else f"{blocks:,}"


def capacity_blocks(blocks: int) -> str:
    """ "4,000 blocks", or "unbounded" for a cache that never runs out."""
    size = capacity(blocks)
    return size if blocks >= UNBOUNDED else f"{size} blocks"


def plural(n: int, noun: str) -> str:
    """ "1 request", "2 requests"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def pct(x: float | None) -> str:
    if x is None or math.isnan(x):
        return NA
    return f"{100 * x:.2f}%"


def ratio(x: float | None) -> str:
    if x is None or math.isnan(x):
        return NA
    return f"{x:.2f}×"


def seconds(x: float | None) -> str:
    if x is None or math.isnan(x):
        return NA
    if x != 0 and abs(x) < 1:
        return f"{1000 * x:.1f} ms"
    return f"{x:.2f} s"


def nbytes(n: float | None, digits: int = 2) -> str:
    """Bytes in binary units, ``digits`` after the point from KiB on."""
    if n is None or math.isnan(n):
        return NA
    if abs(n) < 1024:
        return f"{int(n):,} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.{digits}f} {unit}"


def flops(x: float | None) -> str:
    if x is None or math.isnan(x):
        return NA
    for power, prefix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M")):
        if abs(x) >= 10**power:
            return f"{x / 10**power:.2f} {prefix}FLOP"
    return f"{x:.0f} FLOP"


def model_name(model: object) -> str:
    """A run's model: its name (or id) for a model given as a mapping, else as written."""
    if isinstance(model, dict):
        return str(
            model.get("name") or model.get("id") or ", ".join(f"{k}={v}" for k, v in model.items())
        )
    return str(model)


def signed(text: str) -> str:
    """Prefix a '+' on non-negative formatted deltas."""
    return text if text.startswith(("-", NA)) else f"+{text}"


# ---- charts drawn with characters --------------------------------------------------------------


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
