"""The rows of requests.csv, spooled to disk as the replay produces them.

A replay of any length keeps only a small buffer of rows and the last few hit counts in memory:
each request's integers are packed (int64 LE) and its arrival time appended to a typed buffer,
and both are written to two temporary binary files every few thousand rows.
``write_requests_csv`` later formats them as requests.csv in the run directory, adding the
namespace labels and the serving columns (time to first token, known only once the simulation
ends) by request id.

The files are anonymous (``tempfile.TemporaryFile``: no name on disk on POSIX), so they go when
the rows do, a crash included, with no finalizer to run.
"""

from __future__ import annotations

import csv
import math
import struct
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from prefixcache.run_format import REQUEST_COLUMNS

ROLLING_WINDOW = 200  # requests behind the rolling hit rate
_FLUSH_ROWS = 4096
# the integer columns of a spooled row, in order; arrival_s is spooled apart as a float
INT_COLUMNS = tuple(
    c for c in REQUEST_COLUMNS if c not in ("arrival_s", "ttft_s", "ttft_nocache_s")
)
_WIDTH = len(INT_COLUMNS)
_ROW = struct.Struct(f"<{_WIDTH}q")  # one row's integers, as spooled
_PROMPT = INT_COLUMNS.index("prompt_tokens")
_HIT = INT_COLUMNS.index("hit_tokens")


def format_number(x: float) -> str:
    """A float cell of the run files: empty for NaN, else rounded to 9 decimals."""
    return "" if math.isnan(x) else repr(round(x, 9))


class RequestRows:
    """Rows of requests.csv (all but the serving columns), spooled to temporary files."""

    def __init__(self) -> None:
        # open as long as the rows are (no context manager): closed, and so gone, with them
        tmp = "prefixcache-requests-"
        self._ints_file: IO[bytes] = tempfile.TemporaryFile(prefix=tmp)  # noqa: SIM115
        self._arrivals_file: IO[bytes] = tempfile.TemporaryFile(prefix=tmp)  # noqa: SIM115
        self._rows: list[bytes] = []  # packed rows not written yet
        self._arrivals = array("d")
        self._flushed = 0  # rows written to the files
        self._open = True
        self._tail: list[bytes] = []  # the last rows written (for the rolling hit rate)

    def __len__(self) -> int:
        return self._flushed + len(self._arrivals)

    def add(self, arrival_s: float, row: tuple[int, ...]) -> None:
        """One request: ``row`` holds the ``INT_COLUMNS`` values (namespace as its index)."""
        self._rows.append(_ROW.pack(*row))
        arrivals = self._arrivals
        arrivals.append(arrival_s)
        if len(arrivals) >= _FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        rows = self._rows
        if rows:
            self._tail = (self._tail + rows)[-ROLLING_WINDOW:]
        self._ints_file.write(b"".join(rows))
        self._arrivals.tofile(self._arrivals_file)
        self._flushed += len(self._arrivals)
        self._rows = []
        self._arrivals = array("d")

    def rolling_hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the last ``ROLLING_WINDOW`` requests."""
        rows = self._rows
        last = (rows if len(rows) >= ROLLING_WINDOW else self._tail + rows)[-ROLLING_WINDOW:]
        if not last:
            return 0.0
        table = np.frombuffer(b"".join(last), dtype="<i8").reshape(-1, _WIDTH)
        prompt = int(table[:, _PROMPT].sum())
        return int(table[:, _HIT].sum()) / prompt if prompt else 0.0

    def finish(self) -> None:
        """Flush the rows; no more can be added."""
        if self._open:
            self._flush()
            self._ints_file.flush()
            self._arrivals_file.flush()
            self._open = False

    def set_columns(self, first: int, columns: dict[str, np.ndarray]) -> None:
        """Overwrite integer columns of the rows from ``first`` on (each array: one value a
        row, to the last row): figures known only after the rows were added. Finishes the
        rows."""
        self.finish()
        width = 8 * _WIDTH
        count = len(self) - first
        where = [(INT_COLUMNS.index(name), values) for name, values in columns.items()]
        for name, values in columns.items():
            if len(values) != count:
                raise ValueError(f"{name}: {len(values)} values for {count} rows")
        ints = self._ints_file
        for start in range(0, count, 65_536):
            rows = min(65_536, count - start)
            ints.seek((first + start) * width)
            table = np.frombuffer(ints.read(rows * width), dtype="<i8").reshape(-1, _WIDTH).copy()
            for k, values in where:
                table[:, k] = values[start : start + rows]
            ints.seek((first + start) * width)
            ints.write(table.tobytes())
        ints.flush()

    def chunks(self, rows: int = 65_536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The rows so far, ``rows`` at a time: an int64 array of ``INT_COLUMNS`` per row, and
        the arrival times (read-only arrays)."""
        self.finish()
        ints, arrivals = self._ints_file, self._arrivals_file
        done = 0  # rows read; each read seeks first, so two readers do not interfere
        while True:
            ints.seek(done * 8 * _WIDTH)
            block = ints.read(rows * 8 * _WIDTH)
            if not block:
                return
            count = len(block) // (8 * _WIDTH)
            arrivals.seek(done * 8)
            times = arrivals.read(count * 8)
            done += count
            yield (
                np.frombuffer(block, dtype="<i8").reshape(-1, _WIDTH),
                np.frombuffer(times, dtype=np.float64),
            )

    def column(self, name: str) -> np.ndarray:
        """One integer column of the rows so far (for tests and small replays)."""
        k = INT_COLUMNS.index(name)
        parts = [ints[:, k] for ints, _ in self.chunks()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


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
