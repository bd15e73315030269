"""A progress bar on stderr for long replays, shown only when stderr is a terminal.

Uses tqdm when installed; otherwise a single self-rewriting line. Either way the bar is updated
every few thousand requests, so it costs nothing per request.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_EVERY = 4096


def with_progress(
    items: Iterable[T], total: int | None, label: str, enabled: bool | None = None
) -> Iterator[T]:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(
            total=total, desc=label, unit="req", unit_scale=True, file=sys.stderr, mininterval=0.5
        )
        try:
            pending = 0
            for item in items:
                yield item
                pending += 1
                if pending == _EVERY:
                    bar.update(pending)
                    pending = 0
            bar.update(pending)
        finally:
            bar.close()
        return
    start, count = time.monotonic(), 0
    try:
        for item in items:
            yield item
            count += 1
            if count % _EVERY == 0:
                _line(label, count, total, time.monotonic() - start)
    finally:
        _line(label, count, total, time.monotonic() - start)
        sys.stderr.write("\n")


def _line(label: str, count: int, total: int | None, elapsed: float) -> None:
    rate = count / elapsed if elapsed > 0 else 0.0
    done = f"{count:,}/{total:,} ({100 * count / total:.0f}%)" if total else f"{count:,}"
    sys.stderr.write(f"\r{label}: {done} requests, {rate:,.0f} req/s")
    sys.stderr.flush()
