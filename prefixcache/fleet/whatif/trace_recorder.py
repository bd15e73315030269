"""A trace of what the service routed, for offline replay: one Mooncake trace line per routed
request (``timestamp`` in ms since the recording began, ``input_length``, ``hash_ids``), so that
``prefixcache replay PATH --trace-block-size B`` (B: the replicas' block size) answers the same
what-if questions exactly, next to the live curves.

Never token ids: prompts are private. A block's id is the first 8 bytes of the router's digest of
it, which chains the namespace and every token before it: equal ids mean equal prefixes (as far
as blocks go), and nothing of the text can be read back. A prompt's partial last block gets an
id of its own that no other request has (it is never cached). The replica a request went to and
its tenant are not written either.

``rate`` below 1 records a sample of requests chosen by their first block, so every request that
starts with a sampled system prompt is kept and the sharing between them survives. The file is
rotated by size: past ``max_mib`` it becomes ``PATH.1`` (the older ones ``PATH.2`` ...; ``keep``
of them). Lines are buffered and flushed at least every second and when the service stops.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

FULL = 1 << 64
_UNIQUE = 1 << 63  # ids at or above this are partial blocks' (a counter), never a digest's


@dataclass(frozen=True)
class TraceRecordConfig:
    """Where and how much of the routed traffic is written."""

    path: str | None = None  # None: no trace
    rate: float = 1.0  # share of requests (by first block) written
    max_mib: float = 256.0  # a file is rotated past this size
    keep: int = 5  # rotated files kept


class TraceRecorder:
    """Writes routed requests as Mooncake trace lines (``record``; thread-safe)."""

    def __init__(self, config: TraceRecordConfig) -> None:
        if config.path is None:
            raise ValueError("a trace recorder needs a path")
        self.config = config
        self.path = Path(config.path)
        self._lock = threading.Lock()
        self._threshold = min(FULL, int(config.rate * FULL))
        self._file: IO[str] = self._open()
        self._start: float | None = None
        self._partials = _UNIQUE
        self._flushed = time.monotonic()
        self.written = 0  # lines written since the service started

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8", buffering=1 << 16)

    def record(self, digests: Sequence[bytes], prompt_tokens: int, block_size: int) -> None:
        """One routed prompt: its full blocks' digests (root first) and its length."""
        if not digests and prompt_tokens <= 0:
            return
        sampled_out = digests and int.from_bytes(digests[0][:8], "big") >= self._threshold
        if self._threshold < FULL and sampled_out:
            return
        ids = [int.from_bytes(d[:8], "big") & (_UNIQUE - 1) for d in digests]
        now = time.monotonic()
        with self._lock:
            if block_size > 0 and prompt_tokens % block_size:  # the partial last block
                ids.append(self._partials)
                self._partials += 1
            if self._start is None:
                self._start = now
            ms = round((now - self._start) * 1000)
            self._file.write(
                f'{{"timestamp": {ms}, "input_length": {prompt_tokens}, '
                f'"hash_ids": [{", ".join(map(str, ids))}]}}\n'
            )
            self.written += 1
            if now - self._flushed >= 1.0:
                self._file.flush()
                self._flushed = now
            if self._file.tell() > self.config.max_mib * (1 << 20):
                self._rotate()

    def _rotate(self) -> None:
        """``PATH`` -> ``PATH.1`` -> ... -> ``PATH.<keep>`` (the oldest dropped); a new file."""
        self._file.close()
        keep = self.config.keep
        oldest = Path(f"{self.path}.{keep}")
        if keep > 0 and oldest.exists():
            oldest.unlink()
        for i in range(keep - 1, 0, -1):
            older = Path(f"{self.path}.{i}")
            if older.exists():
                os.replace(older, f"{self.path}.{i + 1}")
        if keep > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            self.path.unlink()
        self._file = self._open()

    def close(self) -> None:
        """Flush and close the file (the service stops)."""
        with self._lock:
            self._file.close()
