from typing import Any

def pack_token_list(tokens: list[Any], /) -> bytes | None:
    """The ids as little-endian int32 bytes when every item is a plain int in [0, 2**31); None
    otherwise (the Python path packs the general case and names what is wrong)."""
