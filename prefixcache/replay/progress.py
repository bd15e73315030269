"""A progress bar on stderr for long replays: tqdm when installed, otherwise one line that
rewrites itself. Updates are batched, so counting costs next to nothing per request: the bar is
redrawn every ``REFRESH_S`` seconds (or every ``FLUSH_EVERY`` items, whichever comes first), and
the clock is read only every few items, as many as pass in a small share of that interval."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
FLUSH_EVERY = 4096  # counted items between redraws, at the most
REFRESH_S = 0.5  # seconds between redraws, at the most
_MAX_STRIDE = 256  # counted items between reads of the clock, at the most
_CHUNK = 1 << 20
LINE_TRACE_KINDS = ("mooncake", "tokens", "prompts")  # one request per line


class Progress:
    """Counts finished items against an optional total and shows rate and time left."""

    def __init__(self, total: int | None, label: str, unit: str = "req") -> None:
        self.total, self.label, self.unit = total, label, unit
        self._base_label = label
        self.count = self._pending = 0
        self._start = self._drawn = time.monotonic()
        self._check_at = 1  # pending items at which the clock is read next
        self._width = 0  # of the line drawn last (the fallback bar)
        self._bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total, desc=label, unit=unit, unit_scale=True, file=sys.stderr, mininterval=0.5
        )

    def update(self, n: int = 1) -> None:
        """Count ``n`` more finished items."""
        self._pending += n
        if self._pending >= self._check_at:
            self._check()

    def _check(self) -> None:
        """Redraw when ``FLUSH_EVERY`` items or ``REFRESH_S`` seconds have passed; then read the
        clock again after about a tenth of the items the interval holds at the rate so far."""
        pending = self._pending
        now = time.monotonic()
        if pending >= FLUSH_EVERY or now - self._drawn >= REFRESH_S:
            self._flush()
            pending = 0
        per_s = (self.count + pending) / max(now - self._start, 1e-3)
        stride = min(max(int(per_s * REFRESH_S / 10), 1), _MAX_STRIDE)
        self._check_at = min(pending + stride, FLUSH_EVERY)

    def stage(self, name: str) -> None:
        """Name the part of the run now counted (one pass of several under one total)."""
        self.label = f"{self._base_label} [{name}]"
        if self._bar is not None:
            self._bar.set_description(self.label, refresh=False)

    def _flush(self) -> None:
        self._drawn = time.monotonic()
        self.count += self._pending
        if self._bar is not None:
            self._bar.update(self._pending)
        else:
            line = self.line()
            sys.stderr.write("\r" + line.ljust(self._width))  # blanks what a longer one left
            self._width = len(line)
            sys.stderr.flush()
        self._pending = 0

    def line(self) -> str:
        """The fallback bar: count, share of the total, rate and estimated time left."""
        elapsed = time.monotonic() - self._start
        rate = self.count / elapsed if elapsed > 0 else 0.0
        if not self.total:
            return f"{self.label}: {self.count:,} {self.unit}, {rate:,.0f} {self.unit}/s"
        left = max(self.total - self.count, 0) / rate if rate > 0 else None
        eta = f", {_clock(left)} left" if left is not None else ""
        return (
            f"{self.label}: {self.count:,}/{self.total:,} ({100 * self.count / self.total:.0f}%) "
            f"{self.unit}, {rate:,.0f} {self.unit}/s{eta}"
        )

    def close(self, finished: bool = True) -> None:
        """Show the final count; a finished run ends at its count even when the total was an
        estimate."""
        if finished and self.total is not None:
            self.total = self.count + self._pending
            if self._bar is not None:
                self._bar.total = self.total
        self._flush()
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")


class SweepProgress(Progress):
    """One bar for a whole sweep: points replayed in this process count into it directly, those
    in worker processes into ``shared`` (a ``multiprocessing.Value``), which ``poll`` reads."""

    def __init__(self, total: int | None, label: str, shared: Any) -> None:
        super().__init__(total, label)
        self.shared = shared
        self._seen = 0

    def poll(self) -> None:
        """Take in what the workers counted since the last poll."""
        seen = self.shared.value
        if seen > self._seen:
            self.update(seen - self._seen)
            self._seen = seen

    def stage(self, name: str) -> None:
        """The passes of the points are not named: they run side by side."""

    def close(self, finished: bool = True) -> None:
        self.poll()
        super().close(finished)


def _clock(seconds: float) -> str:
    s = round(seconds)
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def enabled(flag: bool | None) -> bool:
    """None: show progress when stderr is a terminal."""
    return sys.stderr.isatty() if flag is None else flag


def counted(items: Iterable[T], progress: Progress) -> Iterator[T]:
    """``items``, counting each one taken and closing ``progress`` at the end."""
    finished = False
    try:
        for item in items:
            yield item
            progress.update()
        finished = True
    finally:
        progress.close(finished)


def count_lines(path: str | Path) -> int | None:
    """Requests in a one-request-per-line trace, counted from its newlines without parsing;
    None when the file cannot be read."""
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError:
        return None
    return lines + (last != b"\n")
