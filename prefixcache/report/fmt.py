"""Number formatting shared by every report format, so a figure reads the same everywhere."""

from __future__ import annotations

import math

NA = "n/a"


def count(n: float | None) -> str:
    if n is None or math.isnan(n):
        return NA
    return f"{int(n):,}"


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


def nbytes(n: float | None) -> str:
    if n is None or math.isnan(n):
        return NA
    if abs(n) < 1024:
        return f"{int(n):,} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def flops(x: float | None) -> str:
    if x is None or math.isnan(x):
        return NA
    for power, prefix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M")):
        if abs(x) >= 10**power:
            return f"{x / 10**power:.2f} {prefix}FLOP"
    return f"{x:.0f} FLOP"


def signed(text: str) -> str:
    """Prefix a '+' on non-negative formatted deltas."""
    return text if text.startswith(("-", NA)) else f"+{text}"
