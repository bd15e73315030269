"""Admissions through the tiers of a replay: the manager's GPU and host hits, then the pool.

The manager admits a prompt as usual (GPU hits, host blocks loaded after them). The prompt's
digest chain then continues in the shared pool from the first block neither tier holds; pooled
blocks found there are loaded over the pool link when that is cheaper than recomputing them
(never the prompt's last token: one token is always computed). The manager has allocated and
indexed those blocks as the request's own already, which is what a runtime does once it has
loaded them, so only the count of tokens not computed changes.

How blocks reach the pool follows the pool write policy (``sizes``): ``evict`` pools
the blocks that leave the replica (``PoolFeed``); ``through`` writes the prompt's full blocks
that the admission computes (those past every tier's hits, in chain order) right after the
lookup, so another replica finds them while this one still holds them. Output blocks written
during decode are not written through.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.results import Admission
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.tiers.shared_pool import PoolFeed, PoolTier
from prefixcache.replay.tiers.sizes import TierConfig


class TierHit(NamedTuple):
    """Where an admission's tokens not computed came from."""

    cached_len: int  # prompt tokens not computed, every tier together
    partial_tokens: int  # slots copied from a partially matching GPU block
    gpu_tokens: int  # matched in the GPU index (copies of GPU blocks included)
    host_tokens: int  # loaded from the host tier
    pool_tokens: int  # loaded from the pool
    host_blocks: int  # blocks loaded over the host link
    pool_blocks: int  # blocks loaded over the pool link


class TierAdmitter:
    """One replica's admissions through its manager and the shared pool (if any)."""

    def __init__(
        self, mgr: CacheManager, settings: TierConfig, pool: PoolTier | None = None
    ) -> None:
        self.mgr = mgr
        self.settings = settings
        self.pool = pool
        self.feed: PoolFeed | None = None
        self.write_through = pool is not None and settings.pool_write == "through"
        if pool is not None and not self.write_through:
            self.feed = PoolFeed(pool)
            mgr.add_listener(self.feed, token_ids=False)  # it reads digests only
        self.pool_found_blocks = 0  # pooled blocks that continued a prompt (loaded or not)
        self.pool_loaded_blocks = 0

    def admit(self, request_id: Hashable, tokens: np.ndarray, namespace: Namespace) -> Admission:
        """``mgr.admit``, with the blocks that left the replica since its last call pooled
        first (a block evicted by an earlier call is found in the pool, not recomputed)."""
        if self.feed is not None:
            self.feed.flush()
        return self.mgr.admit(request_id, tokens, namespace)

    def split(
        self,
        buf: bytes,
        namespace: Namespace,
        adm: Admission,
        digests: Sequence[bytes] | None = None,
    ) -> TierHit:
        """The tier split of an admission just made (``buf``: the prompt's int32 LE bytes), the
        pool's continuation of its chain included (``digests``: the block digests of a prefix
        of ``buf``, when the caller has them: a request's prompt, which a resumed request's
        tokens extend; the blocks past them are hashed here)."""
        p = self.mgr.block_size
        host_tokens = adm.host_blocks * p
        gpu_tokens = adm.cached_len - host_tokens
        base = TierHit(
            adm.cached_len, adm.partial_tokens, gpu_tokens, host_tokens, 0, adm.host_blocks, 0
        )
        pool = self.pool
        if pool is None or adm.cow:
            return base
        if self.feed is not None:
            self.feed.flush()  # what this admission evicted is pooled before the lookup
        start = adm.hit_blocks + adm.host_blocks
        t = len(buf) // 4
        limit = (t - 1) // p  # one prompt token is always computed
        full = t // p if self.write_through else limit  # blocks hashed
        if start >= full or (not len(pool) and not self.write_through):
            return base
        known = 0 if digests is None else min(len(digests), full)
        if digests is not None and known == full:
            digests = digests[start:full]
        else:  # hashed here, past the digests given (a resumed request: its prompt's)
            hasher = self.mgr.hasher
            tokens = np.frombuffer(buf, dtype="<i4")
            if digests is not None and known:
                more = hasher.hash_blocks(tokens, digests[known - 1], known, full)
                digests = [*digests[start:known], *more[max(start - known, 0) :]]
            else:
                digests = hasher.hash_blocks(tokens, hasher.seed(namespace), 0, full)[start:]
        k = pool.match(digests[: max(limit - start, 0)])
        hit = base
        if k:
            self.pool_found_blocks += k
            if self.settings.pool_transfer.should_load(k, p, start):
                pool.touch(digests[:k])
                self.pool_loaded_blocks += k
                # a partially matching GPU block is loaded whole from the pool instead of copied
                gpu_tokens -= adm.partial_tokens
                hit = TierHit(
                    (start + k) * p, 0, gpu_tokens, host_tokens, k * p, adm.host_blocks, k
                )
            else:
                k = 0  # found but recomputed: written again below
        if self.write_through:
            for d in digests[k:]:
                pool.put(d)
        return hit


class Tiers(NamedTuple):
    """The tiers of one replay: their settings, the shared pool, one admitter per replica."""

    settings: TierConfig
    pool: PoolTier | None
    admitters: list[TierAdmitter]


def build_tiers(resolved: ResolvedConfig, managers: Sequence[CacheManager]) -> Tiers | None:
    """One admitter per replica's manager, all sharing one pool; None without tiers."""
    settings = resolved.tiers
    if settings is None:
        return None
    pool = PoolTier(settings.pool_blocks) if settings.pool_blocks else None
    return Tiers(settings, pool, [TierAdmitter(m, settings, pool) for m in managers])
