"""Counters of the cache manager. Definitions match the hit accounting in docs/reports.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    """Running counts of one manager's admissions, hits, copies and block movements."""

    requests: int = 0  # admitted requests
    lookup_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # prompt tokens whose K/V were not computed
    lookup_blocks: int = 0  # full prompt blocks
    hit_blocks: int = 0  # full prompt blocks served from the cache (either tier)
    zero_hit_requests: int = 0
    evicted_blocks: int = 0
    cow_copies: int = 0  # copy-on-write copies of shared blocks
    partial_copies: int = 0  # partially matched blocks copied instead of recomputed
    partial_copy_tokens: int = 0
    stored_blocks: int = 0  # blocks entered into the index
    appended_tokens: int = 0
    forks: int = 0
    aborted_requests: int = 0  # dropped before their K/V was written (abort, with dependents)
    unindexed_blocks: int = 0  # blocks taken out of the index because their K/V never came
    # the host tier (all 0 without one)
    host_hit_blocks: int = 0  # prompt blocks found on host at admission (loaded or recomputed)
    loaded_blocks: int = 0  # host blocks loaded into GPU blocks (counted in hit_blocks)
    offloaded_blocks: int = 0  # GPU blocks evicted into the host tier
    host_evicted_blocks: int = 0  # host blocks dropped (evicted, or their parent dropped)
    # a shared K/V store (all 0 without one)
    store_hit_blocks: int = 0  # prompt blocks found in the store at admission (loaded or not)
    store_loaded_blocks: int = 0  # store blocks planned into GPU blocks (counted in hit_blocks)
    store_writes_expired: int = 0  # write-throughs not taken before the next admit or append

    @property
    def token_hit_rate(self) -> float:
        """Prompt tokens not computed, per prompt token admitted."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Full prompt blocks served from the cache, per full prompt block admitted."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    def as_dict(self) -> dict[str, float]:
        """Every counter by name, with both hit rates."""
        d: dict[str, float] = dict(asdict(self))
        d["token_hit_rate"] = self.token_hit_rate
        d["block_hit_rate"] = self.block_hit_rate
        return d


@dataclass(frozen=True)
class BlockCounts:
    """Physical blocks per state; they always add up to ``num_blocks``."""

    free: int
    active: int  # referenced by at least one request or pin (or a copy of the current step)
    cached: int  # in the index, unreferenced, evictable

    @property
    def total(self) -> int:
        """Every physical block of the pool."""
        return self.free + self.active + self.cached
