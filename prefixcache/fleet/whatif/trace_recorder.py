"""A trace of what the service routed, for offline replay: one Mooncake trace line per routed
request (``timestamp`` in ms since the recording began, ``input_length``, ``hash_ids``), so that
``prefixcache replay PATH --trace-block-size B`` (B: the replicas' block size) answers the same
what-if questions exactly, next to the live curves.

Never token ids: prompts are private. A block's id is the first 8 bytes of the router's digest of
it, which chains the namespace and every token before it: equal ids mean equal prefixes (as far
as blocks go), and nothing of the text can be read back. A prompt's partial last block gets an
id of its own that no other request has (it is never cached). The replica a request went to and
its tenant are not written either.

``rate`` below 1 records a sample of requests chosen by their first block (its sampling hash,
``shards.sampling_hash``, under the rate's threshold), so every request that starts with a
sampled system prompt is kept and the sharing between them survives. The ids are blocks of one
size, so the replicas must share one block size (``ConfigError`` otherwise). The file is
rotated by size: past ``max_mib`` it becomes ``PATH.1`` (the older ones ``PATH.2`` ...; ``keep``
of them). Lines are buffered and flushed at least every second and when the service stops. A
service restarted onto a trace it wrote goes on with it: timestamps continue after the newest
line's, and partial blocks' ids start from a random point of their range, so no two runs share
one.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from prefixcache.errors import ConfigError
from prefixcache.fleet.whatif.shards import FULL, sampling_hash, sampling_threshold

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

    def __init__(self, config: TraceRecordConfig, block_sizes: Collection[int] = ()) -> None:
        if config.path is None:
            raise ValueError("a trace recorder needs a path")
        if len(set(block_sizes)) > 1:
            raise ConfigError(
                "record_trace needs replicas of one block size (got "
                f"{', '.join(map(str, sorted(set(block_sizes))))}): a trace's ids are blocks of "
                "one size"
            )
        self.config = config
        self.path = Path(config.path)
        self._lock = threading.Lock()
        self._threshold = sampling_threshold(config.rate)
        self._file: IO[str] = self._open()
        self._start: float | None = None
        self._base_ms = self._resumed_ms()
        self._partials = _UNIQUE + secrets.randbelow(1 << 62)
        self._flushed = time.monotonic()
        self.written = 0  # lines written since the service started

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8", buffering=1 << 16)

    def _resumed_ms(self) -> int:
        """Where this run's timestamps start: after the newest line of the trace already on disk
        (``PATH``, else ``PATH.1``), 0 for a new trace."""
        for path in (self.path, Path(f"{self.path}.1")):
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(0, size - (1 << 16)))
                    tail = f.read().splitlines()
            except OSError:
                continue
            for line in reversed(tail):
                try:
                    stamp = json.loads(line).get("timestamp")
                except (ValueError, AttributeError):
                    continue  # a line cut short by a crash, or the read's first partial line
                if isinstance(stamp, int | float) and not isinstance(stamp, bool):
                    return int(stamp) + 1
        return 0

    def record(self, digests: Sequence[bytes], prompt_tokens: int, block_size: int) -> None:
        """One routed prompt: its full blocks' digests (root first) and its length."""
        if not digests and prompt_tokens <= 0:
            return
        if self._threshold < FULL and digests and sampling_hash(digests[0]) >= self._threshold:
            return
        ids = [sampling_hash(d) & (_UNIQUE - 1) for d in digests]
        now = time.monotonic()
        with self._lock:
            if block_size > 0 and prompt_tokens % block_size:  # the partial last block
                ids.append(self._partials)
                self._partials += 1
            if self._start is None:
                self._start = now
            ms = self._base_ms + round((now - self._start) * 1000)
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

    def window(self) -> list[tuple[BinaryIO, int]]:
        """The recorded window, oldest file first (``PATH.<keep>`` .. ``PATH.1``, ``PATH``),
        flushed, each open for reading with its size now: whole lines, which later writes and
        rotations (an open file survives them) leave as they are. The caller closes them."""
        paths = [Path(f"{self.path}.{i}") for i in range(self.config.keep, 0, -1)]
        files: list[tuple[BinaryIO, int]] = []
        with self._lock:
            self._file.flush()
            try:
                for path in [*paths, self.path]:
                    if path.exists():
                        f: BinaryIO = open(path, "rb")  # noqa: SIM115 (the caller closes it)
                        files.append((f, os.fstat(f.fileno()).st_size))
            except OSError:
                for f, _ in files:
                    f.close()
                raise
            return files

    def close(self) -> None:
        """Flush and close the file (the service stops)."""
        with self._lock:
            self._file.close()
