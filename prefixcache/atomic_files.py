"""Files written whole or not at all: into a temporary sibling, then renamed over the target."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def atomic_open(path: str | Path, newline: str | None = None) -> Iterator[TextIO]:
    """A text file to write; it replaces ``path`` only when the block ends without an error."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline=newline) as f:
            yield f
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8) atomically."""
    with atomic_open(path) as f:
        f.write(text)
