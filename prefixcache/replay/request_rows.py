"""The rows of requests.csv, written to a spool file as the replay produces them.

A replay of any length keeps only a small buffer of rows and the last few hit counts in memory:
each row is formatted as its CSV line when the request is accounted and appended to a temporary
file, which ``write_requests_csv`` later copies into the run directory, adding the serving
columns (time to first token, known only once the simulation ends) by request id.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from prefixcache.run_format import REQUEST_COLUMNS

ROLLING_WINDOW = 200  # requests behind the rolling hit rate
_FLUSH_ROWS = 4096
_SPOOLED = REQUEST_COLUMNS[:-2]  # every column but ttft_s and ttft_nocache_s


def format_number(x: float) -> str:
    """A float cell of the run files: empty for NaN, else rounded to 9 decimals."""
    return "" if math.isnan(x) else repr(round(x, 9))


class RequestRows:
    """Rows of requests.csv (all but the serving columns), spooled to a temporary file."""

    def __init__(self) -> None:
        fd, name = tempfile.mkstemp(prefix="prefixcache-requests-", suffix=".csv")
        self.path = Path(name)
        self._file: IO[str] | None = os.fdopen(fd, "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file, lineterminator="\n")
        self._pending: list[tuple[object, ...]] = []
        self._count = 0
        self._prompt = [0] * ROLLING_WINDOW
        self._hit = [0] * ROLLING_WINDOW
        self._cleanup = weakref.finalize(self, _remove, self.path, self._file)

    def __len__(self) -> int:
        return self._count

    def add(
        self,
        request_id: int,
        arrival_s: float,
        namespace: str,
        prompt_tokens: int,
        hit_tokens: int,
        counts: tuple[int, ...],
    ) -> None:
        """One request: ``counts`` holds prompt_blocks, hit_blocks, the five miss causes and the
        output tokens, in the order of requests.csv."""
        slot = self._count % ROLLING_WINDOW
        self._prompt[slot] = prompt_tokens
        self._hit[slot] = hit_tokens
        self._count += 1
        pending = self._pending
        pending.append(
            (request_id, format_number(arrival_s), namespace, prompt_tokens, hit_tokens, *counts)
        )
        if len(pending) >= _FLUSH_ROWS:
            self._writer.writerows(pending)
            pending.clear()

    def rolling_hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the last ``ROLLING_WINDOW`` requests."""
        prompt = sum(self._prompt)
        return sum(self._hit) / prompt if prompt else 0.0

    def finish(self) -> Path:
        """Flush the rows; the spool file is complete and no more rows can be added."""
        if self._file is not None:
            self._writer.writerows(self._pending)
            self._pending.clear()
            self._file.close()
            self._file = None
        return self.path

    def column(self, name: str) -> np.ndarray:
        """One numeric column of the rows so far (reads the spool back; for small replays)."""
        k = _SPOOLED.index(name)
        with open(self.finish(), newline="", encoding="utf-8") as f:
            return np.array([float(row[k]) for row in csv.reader(f)])


def _remove(path: Path, file: IO[str] | None) -> None:
    if file is not None and not file.closed:
        file.close()
    path.unlink(missing_ok=True)


def write_requests_csv(
    rows: RequestRows | None,
    path: Path,
    ttft: Sequence[float] | None = None,
    ttft_nocache: Sequence[float] | None = None,
) -> None:
    """requests.csv from the spooled rows; ``ttft``/``ttft_nocache`` (serving mode) by request
    id, NaN or missing for requests never served."""
    with open(path, "w", newline="", encoding="utf-8") as out:
        out.write(",".join(REQUEST_COLUMNS) + "\n")
        if rows is None:
            return
        with open(rows.finish(), encoding="utf-8") as spool:
            if ttft is None:
                for line in spool:
                    out.write(f"{line[:-1]},,\n")
                return
            n, m = len(ttft), len(ttft_nocache or ())
            for line in spool:
                i = int(line[: line.index(",")])
                a = format_number(ttft[i]) if i < n else ""
                b = format_number(ttft_nocache[i]) if ttft_nocache is not None and i < m else ""
                out.write(f"{line[:-1]},{a},{b}\n")
