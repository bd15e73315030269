"""Per-tenant GPU blocks of one replica, as its KV events show them, and its evictions, told
apart by whose stores came with them.

A tenant is what the service's keys bind: requests of tenant ``acme`` carry the cache salt
``tenant:acme`` (or ``tenant:acme:<salt>``), which the engine hashes into every block and
reports in its events. Any other salt, or none, is the unscoped view and not counted here (salts
from request bodies are unbounded; tenant names are the keys file's).

An engine evicts to make room for the blocks it is about to compute, and announces both in the
same event batch. A tenant's blocks removed in a batch that stored only other tenants' blocks
are counted as evicted by others; removed in a batch that stored its own blocks too (or none at
all: an engine cleaning up), as its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the router imports ``tenant_of`` without the wire's libraries
    from prefixcache.fleet.events.wire import BlockHash

TENANT_SALT_PREFIX = "tenant:"


def tenant_of(salt: str | None) -> str | None:
    """The tenant a cache salt belongs to (``tenant:NAME[:...]`` -> NAME), or None."""
    if salt is None or not salt.startswith(TENANT_SALT_PREFIX):
        return None
    name = salt[len(TENANT_SALT_PREFIX) :].split(":", 1)[0]
    return name or None


class TenantBlocks(NamedTuple):
    """One tenant's figures on one replica."""

    gpu_blocks: int  # GPU blocks of its namespaces the replica holds now
    evicted_own: int  # its GPU blocks removed in batches that stored its own blocks too
    evicted_by_others: int  # ... in batches that stored only other tenants' blocks


class TenantTally:
    """The tenant of each GPU block a replica holds (by engine hash), the counts per tenant,
    and the batch being applied."""

    __slots__ = ("_removed", "_stored", "by_others", "gpu", "own", "owner")

    def __init__(self) -> None:
        self.owner: dict[BlockHash, str] = {}  # GPU blocks of a tenant -> the tenant
        self.gpu: dict[str, int] = {}
        self.own: dict[str, int] = {}
        self.by_others: dict[str, int] = {}
        self._stored: set[str] = set()  # tenants that stored blocks in the current batch
        self._removed: dict[str, int] = {}  # GPU blocks removed in it, per tenant

    def added(self, block: BlockHash, tenant: str | None) -> None:
        """``block`` of ``tenant`` is on the replica's GPU now."""
        if tenant is None or block in self.owner:
            return
        self.owner[block] = tenant
        self.gpu[tenant] = self.gpu.get(tenant, 0) + 1
        self._stored.add(tenant)

    def removed(self, block: BlockHash) -> None:
        """``block`` left the replica's GPU."""
        tenant = self.owner.pop(block, None)
        if tenant is None:
            return
        self.gpu[tenant] -= 1
        self._removed[tenant] = self._removed.get(tenant, 0) + 1

    def tenant(self, block: BlockHash | None) -> str | None:
        """The tenant of a GPU block the replica holds (None: unscoped or not known)."""
        return None if block is None else self.owner.get(block)

    def end_batch(self) -> None:
        """The batch is applied: its removals are attributed."""
        stored = self._stored
        for tenant, n in self._removed.items():
            counts = self.by_others if stored and tenant not in stored else self.own
            counts[tenant] = counts.get(tenant, 0) + n
        self._removed.clear()
        stored.clear()

    def clear(self) -> None:
        """The replica holds nothing any more (the eviction counters stay)."""
        self.owner.clear()
        self.gpu.clear()
        self._removed.clear()
        self._stored.clear()

    def gpu_blocks(self, tenant: str) -> int:
        """The tenant's GPU blocks on the replica now (a read without the subscriber's lock)."""
        return self.gpu.get(tenant, 0)

    def snapshot(self) -> dict[str, TenantBlocks]:
        """Every tenant seen, and its figures."""
        names = set(self.gpu) | set(self.own) | set(self.by_others)
        return {
            t: TenantBlocks(self.gpu.get(t, 0), self.own.get(t, 0), self.by_others.get(t, 0))
            for t in sorted(names)
        }
