"""Attention kernels over paged K/V (installed as ``prefixcache.kernels``).

``reference`` holds the torch definitions of truth; the Triton kernels live beside it.
"""

from prefixcache.kernels.reference import reference_attention

__all__ = ["reference_attention"]
