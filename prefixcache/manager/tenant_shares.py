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
from prefixcache.blocks.hashing import DIGEST_SIZE
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


class Victim:
    """The leaf to evict from next, and how many of its blocks may go (a plain class, not a
    NamedTuple: one is made per eviction)."""

    __slots__ = ("breaks_guarantee", "limit", "node")

    def __init__(self, node: Node, limit: int, breaks_guarantee: bool) -> None:
        self.node = node
        self.limit = limit  # its tenant's blocks over the guarantee (or every block of the node)
        self.breaks_guarantee = breaks_guarantee  # taken under the guarantee: nothing else was


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


class TenantCounters:
    """One tenant's eviction counters (a row of ``TenantLedger``)."""

    __slots__ = ("breaks", "by_others", "capped", "evicted", "recomputed")

    def __init__(self) -> None:
        self.evicted = 0
        self.by_others = 0
        self.recomputed = 0
        self.capped = 0
        self.breaks = 0


class TenantLedger:
    """Per-tenant eviction counters, and the runs of blocks another tenant evicted (so the
    blocks a tenant computes again because of a neighbour are counted). A run is remembered
    as one entry, its first digest -> all its digests; the blocks remembered are bounded: past
    ``limit`` the oldest runs are forgotten."""

    __slots__ = ("limit", "lost", "lost_blocks", "rows")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows: dict[str | None, TenantCounters] = {}
        # runs evicted by another tenant, oldest first: first digest -> the run's digests
        self.lost: OrderedDict[bytes, bytes] = OrderedDict()
        self.lost_blocks = 0

    def row(self, tenant: str | None) -> TenantCounters:
        """``tenant``'s counters (made at first use)."""
        row = self.rows.get(tenant)
        if row is None:
            row = self.rows[tenant] = TenantCounters()
        return row

    def note_eviction(
        self, victim: str | None, cause: str | None, node: Node, k: int, capped: bool, breaks: bool
    ) -> None:
        """The last ``k`` blocks of ``node`` (a leaf of ``victim``, its digests still in place)
        leave the GPU for an allocation of ``cause``."""
        row = self.row(victim)
        row.evicted += k
        if capped:
            row.capped += k
        if breaks:
            row.breaks += k
        if victim != cause:
            row.by_others += k
            run = bytes(node.digests[-k * DIGEST_SIZE :])
            self._remember(run)
            lost = self.lost
            while self.lost_blocks > self.limit:
                _, old = lost.popitem(last=False)
                self.lost_blocks -= len(old) // DIGEST_SIZE

    def _remember(self, run: bytes) -> None:
        first = run[:DIGEST_SIZE]
        old = self.lost.pop(first, None)
        if old is not None:
            self.lost_blocks -= len(old) // DIGEST_SIZE
        self.lost[first] = run
        self.lost_blocks += len(run) // DIGEST_SIZE

    def note_stored(self, tenant: str | None, digests: list[bytes], start: int = 0) -> None:
        """``tenant`` computed and stored ``digests[start:]`` (a run of one chain): those
        another tenant had evicted count as recomputed after others."""
        lost = self.lost
        if not lost:
            return
        n = 0
        i = start
        m = len(digests)
        while i < m:
            if digests[i] not in lost:
                i += 1
                continue
            run = lost.pop(digests[i])
            k = len(run) // DIGEST_SIZE
            self.lost_blocks -= k
            j = 1  # the run is matched as far as the stored digests follow it
            while j < k and i + j < m:
                if digests[i + j] != run[j * DIGEST_SIZE : (j + 1) * DIGEST_SIZE]:
                    break
                j += 1
            if j < k:  # the rest of the run is still lost
                self._remember(run[j * DIGEST_SIZE :])
            n += j
            i += j
        if n:
            self.row(tenant).recomputed += n

    def forget_lost(self) -> None:
        """Forget every run remembered (what was evicted before an index reset is not missed)."""
        self.lost.clear()
        self.lost_blocks = 0


class TenantHeap(Evictor):
    """The evictable leaves of one tenant with a share, and where it stands in the tenants'
    heap."""

    def __init__(self, policy: str | PolicyKey, tenant: str, guaranteed: int) -> None:
        super().__init__(policy)
        self.tenant = tenant
        self.guaranteed = guaranteed
        self.filed: Any = None  # the smallest key it is filed under in the tenants' heap
        self.parked = False  # found at or under its guarantee: out of the tenants' heap


class ShareEvictor(Evictor):
    """The eviction order with tenant shares: the policy's order over tenants without a share
    and tenants over their guarantee; tenants at their guarantee last.

    Its own heap (the base class's) holds the leaves of tenants without a share; each tenant
    with a share has its own ``TenantHeap``. ``_heads`` files each such tenant under its oldest
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
        self.heaps: dict[str, TenantHeap] = {
            t: TenantHeap(policy, t, share.guaranteed) for t, share in self.shares.items()
        }
        self._heads: list[tuple[Any, int, TenantHeap]] = []  # (oldest key, order, its heap)
        self._order = 0
        self._last: Evictor = self  # the heap the last push went to (the one to compact)

    def push(self, node: Node, now: float) -> Any:
        """File an evictable leaf in its tenant's heap (or the common one); returns its key."""
        namespace = node.namespace
        tenant = namespace.salt if namespace is not None else None
        heap = self.heaps.get(tenant) if tenant is not None else None
        if heap is None:
            self._last = self
            return Evictor.push(self, node, now)
        self._last = heap
        key = heap.push(node, now)
        if heap.parked:  # back among the candidates once past its guarantee again
            if self.counts.get(heap.tenant, 0) <= heap.guaranteed:
                return key
            heap.parked = False
            top = heap.peek(now)
            if top is not None:
                self._file(heap, top[0])
            return key
        if heap.filed is None or key < heap.filed:
            self._file(heap, key)
        return key

    def _file(self, heap: TenantHeap, key: Any) -> None:
        self._order += 1
        heapq.heappush(self._heads, (key, self._order, heap))
        heap.filed = key

    def _share_head(self, now: float) -> TenantHeap | None:
        """The heap of the tenant with the oldest key among tenants with a share that are over
        their guarantee (filed under that key: ``filed``)."""
        heads, counts = self._heads, self.counts
        while heads:
            key, _, heap = heads[0]
            top = heap.own_top_key(now)
            if top is None:  # nothing of it is evictable now
                heapq.heappop(heads)
                heap.filed = None
                continue
            if top != key:  # its oldest leaf went or changed: file it under the new one
                self._order += 1
                heapq.heapreplace(heads, (top, self._order, heap))
                heap.filed = top
                continue
            if counts.get(heap.tenant, 0) <= heap.guaranteed:
                heapq.heappop(heads)
                heap.filed = None
                heap.parked = True
                continue
            return heap
        return None

    def pop_victim(self, now: float) -> Victim | None:
        """The next leaf to evict from, and how many of its blocks may go; None when nothing
        is evictable."""
        common = Evictor.own_top_key(self, now)
        share = self._share_head(now)
        if share is not None and (common is None or share.filed < common):
            node = share.pop_own_top()
            return Victim(node, self.counts[share.tenant] - share.guaranteed, False)
        if common is not None:
            node = self.pop_own_top()
            return Victim(node, len(node.blocks), False)
        best: TenantHeap | None = None  # the last resort: the oldest guaranteed block
        best_key: Any = None
        for heap in self.heaps.values():
            if not heap.parked:
                continue
            top = heap.own_top_key(now)
            if top is not None and (best is None or top < best_key):
                best, best_key = heap, top
        if best is None:
            return None
        node = best.pop_own_top()
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
            best: dict[str, tuple[Any, int, TenantHeap]] = {}
            for entry in self._heads:
                t = entry[2].tenant
                if t not in best or entry[0] < best[t][0]:
                    best[t] = entry
            self._heads = list(best.values())
            heapq.heapify(self._heads)

    def clear(self) -> None:
        """Forget every entry of every tenant."""
        Evictor.clear(self)
        for heap in self.heaps.values():
            heap.clear()
            heap.filed = None
            heap.parked = False
        self._heads.clear()

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
    names: set[str | None] = set(counts) | set(shares) | set(ledger.rows)
    out: dict[str | None, TenantStats] = {}
    none = TenantCounters()
    for t in sorted(names, key=lambda t: (t is not None, t or "")):
        share = shares.get(t) if t is not None else None
        row = ledger.rows.get(t, none)
        out[t] = TenantStats(
            counts.get(t, 0),
            share.guaranteed if share is not None else 0,
            share.cap if share is not None else None,
            row.evicted,
            row.by_others,
            row.recomputed,
            row.capped,
            row.breaks,
        )
    return out
