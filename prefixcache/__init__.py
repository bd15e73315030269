"""prefixcache: a prefix cache for LLM inference.

Full KV blocks are identified by chained 128-bit hashes over token ids, namespace and position; a
radix index maps prefixes to shared physical blocks with refcounts, eviction and copy-on-write.
"""

from typing import TYPE_CHECKING, Any

from prefixcache.native import CORE_BUILD  # first: it decides which build of the core loads

# isort: split
from prefixcache.blocks.eviction import POLICIES
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.errors import (
    CacheInUseError,
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PrefixCacheError,
    RequestTooLargeError,
    UnknownRequestError,
)
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.lower_tiers.transfers import Load, Offload, TransferModel, Transfers
from prefixcache.manager.results import Admission, AppendResult, Copy, Lookup
from prefixcache.manager.stats import BlockCounts, CacheStats
from prefixcache.manager.tenant_shares import TenantShare, TenantStats

if TYPE_CHECKING:
    from prefixcache.kv_cache import PagedKVCache

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # torch is imported only by code that stores K/V, so the CLI and replay start fast
    if name == "PagedKVCache":
        from prefixcache.kv_cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")


__all__ = [
    "CORE_BUILD",
    "DEFAULT_NAMESPACE",
    "POLICIES",
    "Admission",
    "AllBlocksCleared",
    "AppendResult",
    "BlockCounts",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CacheInUseError",
    "CacheManager",
    "CacheStats",
    "ConfigError",
    "Copy",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidTokensError",
    "Load",
    "Lookup",
    "Namespace",
    "Offload",
    "OutOfBlocksError",
    "PagedKVCache",
    "PrefixCacheError",
    "RequestTooLargeError",
    "TenantShare",
    "TenantStats",
    "TransferModel",
    "Transfers",
    "UnknownRequestError",
    "__version__",
]
