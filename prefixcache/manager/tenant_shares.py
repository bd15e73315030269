"""Tenant shares: a guaranteed minimum and an optional cap of cached GPU blocks per tenant, and
the eviction order they give.

A tenant is a cache salt (``Namespace.salt``): blocks of two tenants never share a digest, so
every cached block belongs to exactly one tenant and the counts are exact
(``RadixIndex.tenant_blocks``). A tenant's count includes the blocks its running requests hold;
those are never evicted, they only fill the guarantee.

- **Guarantee**: another tenant's allocation evicts from tenants over their guarantee (and from
  tenants without a share) first, in the policy's order across all of them; a tenant at or
  under its guarantee gives way only when nothing else in the cache is evictable and the
  allocation fits (the alternative would be refusing a request the capacity admits). Such a
  block is counted in ``guarantee_breaks``; shares that sum to less than the pool, less the
  blocks running requests hold, never need one.
- **Cap**: a tenant whose count would pass its cap evicts its own oldest blocks before it
  grows, even while other blocks are free. Blocks its running requests hold cannot go, so a
  tenant whose working set alone exceeds its cap grows past it.

``ShareEvictor`` keeps one heap per tenant with a share and one for everything else, and a heap
of the tenants' oldest keys, so picking a victim costs O(log tenants), not a scan. A tenant found
at its guarantee is parked, out of that heap, and comes back when one of its leaves is filed
while it holds more than its guarantee (its blocks become evictable at a release).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

from prefixcache.blocks.eviction import Evictor, PolicyKey
from prefixcache.blocks.radix import Node
from prefixcache.errors import ConfigError

LOST_LIMIT_FACTOR = 4  # digests evicted by another tenant remembered, per block of the pool


class TenantShare(NamedTuple):
    """One tenant's share of the GPU cache, in blocks."""

    guaranteed: int = 0  # other tenants' allocations leave it at least this many cached blocks
    cap: int | None = None  # over this many it evicts its own blocks before growing (None: no cap)


class TenantStats(NamedTuple):
    """One tenant's blocks and evictions (``CacheManager.tenant_stats``)."""

    cached_blocks: int  # GPU blocks of its namespaces in the index now (running requests' too)
    guaranteed: int  # its share's guarantee (0 without a share)
    cap: int | None  # its share's cap (None: none)
    evicted_blocks: int  # of its blocks, evicted from the GPU
    evicted_by_others: int  # ... by another tenant's allocation
    recomputed_after_others: int  # blocks it computed again that another tenant had evicted
    cap_evictions: int  # of its blocks, evicted at its cap, before it grew
    guarantee_breaks: int  # of its blocks, evicted under its guarantee (nothing else was left)


class Victim(NamedTuple):
    """The leaf to evict from next, and how many of its blocks may go."""

    node: Node
    limit: int  # its tenant's blocks over the guarantee (or every block of the node)
    breaks_guarantee: bool  # taken under its tenant's guarantee: nothing else was evictable


def check_shares(shares: object, num_blocks: int) -> dict[str, TenantShare]:
    """The shares as a dict of tenant -> TenantShare, checked: tenants are cache salts
    (non-empty str), guarantees and caps are block counts, a cap is at least the guarantee,
    and the guarantees fit in the pool. Accepts ``(guaranteed, cap)`` pairs or bare
    guarantees for the values."""
    if not isinstance(shares, Mapping):
        raise ConfigError(
            f"shares must map tenant (cache salt) -> TenantShare(guaranteed, cap), got {shares!r}"
        )
    out: dict[str, TenantShare] = {}
    for tenant, value in shares.items():
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"a share's tenant is a non-empty cache salt (str), got {tenant!r}")
        if type(value) is int:
            value = TenantShare(value)
        elif isinstance(value, tuple) and not isinstance(value, TenantShare):
            value = TenantShare(*value)
        if not isinstance(value, TenantShare):
            raise ConfigError(
                f"tenant {tenant!r}: a share is TenantShare(guaranteed, cap), got {value!r}"
            )
        guaranteed, cap = value
        if type(guaranteed) is not int or guaranteed < 0:
            raise ConfigError(
                f"tenant {tenant!r}: the guarantee is a block count >= 0, got {guaranteed!r}"
            )
        if cap is not None and (type(cap) is not int or cap < max(guaranteed, 1)):
            raise ConfigError(
                f"tenant {tenant!r}: the cap is a block count >= the guarantee ({guaranteed}) "
                f"and >= 1, or None, got {cap!r}"
            )
        out[tenant] = TenantShare(guaranteed, cap)
    total = sum(s.guaranteed for s in out.values())
    if total > num_blocks:
        raise ConfigError(
            f"the guarantees add up to {total} blocks, more than the pool's {num_blocks}"
        )
    return out


class TenantLedger:
    """Per-tenant eviction counters, and the digests another tenant evicted (so the blocks a
    tenant computes again because of a neighbour are counted). The digests kept are bounded:
    past ``limit`` the oldest are forgotten."""

    __slots__ = ("breaks", "by_others", "capped", "evicted", "limit", "lost", "recomputed")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.evicted: dict[str | None, int] = {}
        self.by_others: dict[str | None, int] = {}
        self.recomputed: dict[str | None, int] = {}
        self.capped: dict[str | None, int] = {}
        self.breaks: dict[str | None, int] = {}
        # digests evicted by another tenant, oldest first
        self.lost: OrderedDict[bytes, None] = OrderedDict()

    def note_eviction(
        self,
        victim: str | None,
        cause: str | None,
        digests: bytes,
        k: int,
        capped: bool,
        breaks: bool,
    ) -> None:
        """``k`` blocks of ``victim`` (``digests``: theirs, 16 bytes each) left the GPU for an
        allocation of ``cause``."""
        _add(self.evicted, victim, k)
        if capped:
            _add(self.capped, victim, k)
        if breaks:
            _add(self.breaks, victim, k)
        if victim != cause:
            _add(self.by_others, victim, k)
            lost = self.lost
            for i in range(0, len(digests), 16):
                lost[digests[i : i + 16]] = None
            for _ in range(len(lost) - self.limit):
                lost.popitem(last=False)

    def note_stored(self, tenant: str | None, digests: list[bytes]) -> None:
        """``tenant`` computed and stored these blocks: those another tenant had evicted count
        as recomputed after others."""
        lost = self.lost
        if not lost:
            return
        n = 0
        for d in digests:
            if d in lost:
                del lost[d]
                n += 1
        if n:
            _add(self.recomputed, tenant, n)

    def tenants(self) -> set[str | None]:
        """Every tenant with a counter."""
        out: set[str | None] = set()
        for counts in (self.evicted, self.recomputed):
            out.update(counts)
        return out


def _add(counts: dict[str | None, int], tenant: str | None, k: int) -> None:
    counts[tenant] = counts.get(tenant, 0) + k


class ShareEvictor(Evictor):
    """The eviction order with tenant shares: the policy's order over tenants without a share
    and tenants over their guarantee; tenants at their guarantee last.

    Its own heap (the base class's) holds the leaves of tenants without a share; each tenant
    with a share has its own ``Evictor``. ``_heads`` files each such tenant under its oldest
    key (lazily: an entry is checked against the tenant's heap when it comes up); a tenant at
    or under its guarantee is parked until a leaf of it is filed while it is past it.
    """

    def __init__(
        self,
        policy: str | PolicyKey,
        shares: Mapping[str, TenantShare],
        counts: dict[str | None, int],
    ) -> None:
        super().__init__(policy)
        self.policy = policy
        self.shares: dict[str, TenantShare] = dict(shares)
        self.counts = counts  # the index's tenant_blocks (rebound when the index is replaced)
        self.heaps: dict[str, Evictor] = {t: Evictor(policy) for t in self.shares}
        self._heads: list[tuple[Any, int, str]] = []  # (oldest key, order, tenant)
        self._filed: dict[str, Any] = {}  # tenant -> the smallest key it is filed under
        self._parked: set[str] = set()  # tenants at or under their guarantee
        self._order = 0
        self._last: Evictor = self  # the heap the last push went to (the one to compact)

    def _tenant_heap(self, node: Node) -> tuple[str | None, Evictor | None]:
        namespace = node.namespace
        tenant = namespace.salt if namespace is not None else None
        if tenant is None:
            return None, None
        return tenant, self.heaps.get(tenant)

    def push(self, node: Node, now: float) -> Any:
        """File an evictable leaf in its tenant's heap (or the common one); returns its key."""
        tenant, heap = self._tenant_heap(node)
        if heap is None or tenant is None:
            self._last = self
            return Evictor.push(self, node, now)
        self._last = heap
        key = heap.push(node, now)
        if tenant in self._parked:  # back among the candidates once past its guarantee again
            if self.counts.get(tenant, 0) <= self.shares[tenant].guaranteed:
                return key
            self._parked.discard(tenant)
            top = heap.peek(now)
            if top is not None:
                self._file(tenant, top[0])
            return key
        filed = self._filed.get(tenant)
        if filed is None or key < filed:
            self._file(tenant, key)
        return key

    def _file(self, tenant: str, key: Any) -> None:
        self._order += 1
        heapq.heappush(self._heads, (key, self._order, tenant))
        self._filed[tenant] = key

    def _share_head(self, now: float) -> tuple[Any, str] | None:
        """The oldest key among tenants with a share that are over their guarantee."""
        heads, counts, shares = self._heads, self.counts, self.shares
        while heads:
            key, _, tenant = heads[0]
            top = self.heaps[tenant].peek(now)
            if top is None:  # nothing of it is evictable now
                heapq.heappop(heads)
                self._filed.pop(tenant, None)
                continue
            if top[0] != key:  # its oldest leaf went or changed: file it under the new one
                self._order += 1
                heapq.heapreplace(heads, (top[0], self._order, tenant))
                self._filed[tenant] = top[0]
                continue
            if counts.get(tenant, 0) <= shares[tenant].guaranteed:
                heapq.heappop(heads)
                self._filed.pop(tenant, None)
                self._parked.add(tenant)
                continue
            return key, tenant
        return None

    def pop_victim(self, now: float) -> Victim | None:
        """The next leaf to evict from, and how many of its blocks may go; None when nothing
        is evictable."""
        common = Evictor.peek(self, now)
        share = self._share_head(now)
        if share is not None and (common is None or share[0] < common[0]):
            tenant = share[1]
            node = self.heaps[tenant].pop(now)
            assert node is not None
            return Victim(node, self.counts[tenant] - self.shares[tenant].guaranteed, False)
        if common is not None:
            node = Evictor.pop(self, now)
            assert node is not None
            return Victim(node, len(node.blocks), False)
        best: tuple[Any, str] | None = None  # the last resort: the oldest guaranteed block
        for tenant in self._parked:
            top = self.heaps[tenant].peek(now)
            if top is not None and (best is None or top[0] < best[0]):
                best = top[0], tenant
        if best is None:
            return None
        node = self.heaps[best[1]].pop(now)
        assert node is not None
        return Victim(node, len(node.blocks), True)

    def pop_own(self, tenant: str, now: float) -> Node | None:
        """The oldest evictable leaf of ``tenant`` (a tenant with a share), or None."""
        heap = self.heaps.get(tenant)
        return heap.pop(now) if heap is not None else None

    def pop(self, now: float) -> Node | None:
        """The next victim's leaf (guarantees kept where anything else is evictable)."""
        victim = self.pop_victim(now)
        return victim.node if victim is not None else None

    def peek(self, now: float) -> tuple[Any, Node] | None:
        """The oldest evictable leaf of any tenant, left in place."""
        best = Evictor.peek(self, now)
        for heap in self.heaps.values():
            top = heap.peek(now)
            if top is not None and (best is None or top[0] < best[0]):
                best = top
        return best

    def compact(self, live_nodes: int) -> None:
        """Drop stale entries of the heap the last push went to once they outnumber the live
        nodes (each heap is compacted as it grows), and of the tenants' heap."""
        last = self._last
        if last is self:
            Evictor.compact(self, live_nodes)
        else:
            last.compact(live_nodes)
        if len(self._heads) > 4 * len(self.heaps) + 64:
            best: dict[str, tuple[Any, int, str]] = {}
            for entry in self._heads:
                t = entry[2]
                if t not in best or entry[0] < best[t][0]:
                    best[t] = entry
            self._heads = list(best.values())
            heapq.heapify(self._heads)

    def clear(self) -> None:
        """Forget every entry of every tenant."""
        Evictor.clear(self)
        for heap in self.heaps.values():
            heap.clear()
        self._heads.clear()
        self._filed.clear()
        self._parked.clear()

    def __len__(self) -> int:
        """Entries in every heap, stale ones included."""
        return Evictor.__len__(self) + sum(len(h) for h in self.heaps.values())


def share_evictor_for(
    old: Evictor, shares: Mapping[str, TenantShare] | None, counts: dict[str | None, int]
) -> Evictor:
    """A new eviction order for ``shares`` (None: the plain policy order) with the same policy
    as ``old``; the caller files the evictable leaves into it."""
    if shares is None:
        return Evictor(old.key)
    return ShareEvictor(old.key, shares, counts)


def tenant_rows(
    counts: Mapping[str | None, int],
    shares: Mapping[str, TenantShare],
    ledger: TenantLedger,
) -> dict[str | None, TenantStats]:
    """Every tenant with cached blocks, a share or a counter, and its figures."""
    names: set[str | None] = set(counts) | set(shares) | ledger.tenants()
    out: dict[str | None, TenantStats] = {}
    for t in sorted(names, key=lambda t: (t is not None, t or "")):
        share = shares.get(t) if t is not None else None
        out[t] = TenantStats(
            counts.get(t, 0),
            share.guaranteed if share is not None else 0,
            share.cap if share is not None else None,
            ledger.evicted.get(t, 0),
            ledger.by_others.get(t, 0),
            ledger.recomputed.get(t, 0),
            ledger.capped.get(t, 0),
            ledger.breaks.get(t, 0),
        )
    return out
