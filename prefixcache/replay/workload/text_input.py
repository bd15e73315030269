"""Reading text input as UTF-8, naming the line of the first byte that is not."""

from __future__ import annotations

from pathlib import Path

from prefixcache.replay.workload.input_errors import TraceFormatError


def not_utf8_error(path: str, line: int, exc: UnicodeDecodeError) -> TraceFormatError:
    """The TraceFormatError (returned, not raised) for 1-based ``line`` of ``path`` that is
    not UTF-8, naming the file, the line and the first bad byte of ``exc``."""
    return TraceFormatError(
        path, line, f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save the file as UTF-8"
    )


def read_utf8(path: str | Path) -> str:
    """A whole file as text. Bytes that are not UTF-8 raise TraceFormatError naming the line;
    a file that cannot be read raises OSError."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8_error(str(path), data.count(b"\n", 0, exc.start) + 1, exc) from None
