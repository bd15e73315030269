"""Block events, carrying what vLLM's KV events carry, for global indexes and routers.

Plain records, as vLLM's (msgspec structs, not frozen): every listener gets the same instance,
so a listener reads it and never changes it. Not frozen, one is built in about a fifth of the
time (the manager builds one for each run of blocks it stores or drops).

With a host tier, an offload is ``BlockRemoved`` (GPU) then ``BlockStored`` (CPU); a load is
``BlockRemoved`` (CPU) then the usual ``BlockStored`` (GPU); a host eviction is ``BlockRemoved``
(CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.blocks.namespace import Namespace
from prefixcache.medium import GPU, Medium


@dataclass(slots=True)
class BlockStored:
    """A run of consecutive full blocks entered the cache."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None when the first block starts the sequence
    token_ids: list[int]
    block_size: int
    namespace: Namespace
    medium: Medium = GPU  # where the blocks now live: GPU, CPU (the host tier) or STORE


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the cache's ``medium`` (evicted, offloaded, loaded or dropped)."""

    block_hashes: list[bytes]
    namespace: Namespace
    medium: Medium = GPU  # GPU, CPU (the host tier) or STORE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The cache was reset."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventListener = Callable[[CacheEvent], None]
