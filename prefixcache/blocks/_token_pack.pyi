from typing import Any

def pack_token_list(tokens: list[Any], /) -> bytes | None:
    """The ids as little-endian int32 bytes when every item is a plain int in [0, 2**31); None
    otherwise (the Python path packs the general case and names what is wrong)."""

def int32_nonnegative(data: bytes, /) -> bool:
    """Whether every little-endian int32 in ``data`` is >= 0 (its length a multiple of 4)."""
