"""The rows of requests.csv, spooled to disk as the replay produces them.

A replay of any length keeps only a small buffer of rows and the last few hit counts in memory:
each request's integers and arrival time are appended to typed buffers, which are written to two
temporary binary files every few thousand rows. ``write_requests_csv`` later formats them as
requests.csv in the run directory, adding the namespace labels and the serving columns (time to
first token, known only once the simulation ends) by request id.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
import weakref
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from prefixcache.run_format import REQUEST_COLUMNS

ROLLING_WINDOW = 200  # requests behind the rolling hit rate
_FLUSH_ROWS = 4096
# the integer columns of a spooled row, in order; arrival_s is spooled apart as a float
INT_COLUMNS = tuple(
    c for c in REQUEST_COLUMNS if c not in ("arrival_s", "ttft_s", "ttft_nocache_s")
)
_WIDTH = len(INT_COLUMNS)
_PROMPT = INT_COLUMNS.index("prompt_tokens")
_HIT = INT_COLUMNS.index("hit_tokens")


def format_number(x: float) -> str:
    """A float cell of the run files: empty for NaN, else rounded to 9 decimals."""
    return "" if math.isnan(x) else repr(round(x, 9))


class RequestRows:
    """Rows of requests.csv (all but the serving columns), spooled to temporary files."""

    def __init__(self) -> None:
        self._paths: list[Path] = []
        files: list[BinaryIO] = []
        for kind in ("ints", "arrivals"):
            fd, name = tempfile.mkstemp(prefix=f"prefixcache-requests-{kind}-")
            self._paths.append(Path(name))
            files.append(os.fdopen(fd, "wb"))
        self._ints_file, self._arrivals_file = files
        self._ints = array("q")
        self._arrivals = array("d")
        self._flushed = 0  # rows written to the files
        self._open = True
        self._tail = array("q")  # the last rows flushed (for the rolling hit rate)
        self._cleanup = weakref.finalize(self, _remove, list(self._paths), files)

    def __len__(self) -> int:
        return self._flushed + len(self._arrivals)

    def add(self, arrival_s: float, row: tuple[int, ...]) -> None:
        """One request: ``row`` holds the ``INT_COLUMNS`` values (namespace as its index)."""
        self._ints.extend(row)
        arrivals = self._arrivals
        arrivals.append(arrival_s)
        if len(arrivals) >= _FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        ints = self._ints
        if len(ints):
            self._tail = (self._tail + ints)[-ROLLING_WINDOW * _WIDTH :]
        ints.tofile(self._ints_file)
        self._arrivals.tofile(self._arrivals_file)
        self._flushed += len(self._arrivals)
        self._ints = array("q")
        self._arrivals = array("d")

    def rolling_hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the last ``ROLLING_WINDOW`` requests."""
        span = ROLLING_WINDOW * _WIDTH
        ints = self._ints
        last = ints[-span:] if len(ints) >= span else (self._tail + ints)[-span:]
        prompt = sum(last[_PROMPT::_WIDTH])
        return sum(last[_HIT::_WIDTH]) / prompt if prompt else 0.0

    def finish(self) -> None:
        """Flush the rows; no more can be added."""
        if self._open:
            self._flush()
            self._ints_file.close()
            self._arrivals_file.close()
            self._open = False

    def chunks(self, rows: int = 65_536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The rows so far, ``rows`` at a time: an int64 array of ``INT_COLUMNS`` per row, and
        the arrival times."""
        self.finish()
        with open(self._paths[0], "rb") as ints, open(self._paths[1], "rb") as arrivals:
            while True:
                block = np.fromfile(ints, dtype=np.int64, count=rows * _WIDTH)
                if not len(block):
                    return
                yield (
                    block.reshape(-1, _WIDTH),
                    np.fromfile(arrivals, np.float64, len(block) // _WIDTH),
                )

    def column(self, name: str) -> np.ndarray:
        """One integer column of the rows so far (for tests and small replays)."""
        k = INT_COLUMNS.index(name)
        parts = [ints[:, k] for ints, _ in self.chunks()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _remove(paths: list[Path], files: list[BinaryIO]) -> None:
    for f in files:
        if not f.closed:
            f.close()
    for path in paths:
        path.unlink(missing_ok=True)


def write_requests_csv(
    rows: RequestRows | None,
    labels: Sequence[str],
    path: Path,
    ttft: Sequence[float] | None = None,
    ttft_nocache: Sequence[float] | None = None,
) -> None:
    """requests.csv from the spooled rows; ``labels``: the namespaces by index;
    ``ttft``/``ttft_nocache`` (serving mode) by request id, NaN or missing for requests never
    served."""
    with open(path, "w", newline="", encoding="utf-8") as out:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        if rows is None:
            return
        n, m = len(ttft or ()), len(ttft_nocache or ())
        for ints, arrivals in rows.chunks():
            ids = ints[:, 0].tolist()
            if ttft is None:
                with_cache = without = [""] * len(ids)
            else:
                with_cache = [format_number(ttft[i]) if i < n else "" for i in ids]
                without = [
                    format_number(ttft_nocache[i]) if ttft_nocache is not None and i < m else ""
                    for i in ids
                ]
            cols = ints.T.tolist()
            w.writerows(
                zip(
                    ids,
                    map(format_number, arrivals.tolist()),
                    (labels[k] for k in cols[1]),
                    *cols[2:],
                    with_cache,
                    without,
                    strict=True,
                )
            )
