"""A deep snapshot of a CacheManager's state, to prove rejected calls change nothing."""

from __future__ import annotations

from typing import Any

from prefixcache.blocks.radix import Node
from prefixcache.manager.cache_manager import CacheManager


def _node(node: Node) -> tuple[Any, ...]:
    children = sorted((k, _node(c)) for k, c in (node.children or {}).items())
    return (
        bytes(node.digests),
        bytes(node.tokens),
        list(node.blocks),
        node.ref,
        node.depth,
        node.last_access,
        node.hits,
        node.priority,
        node.retain_until,
        tuple(children),
    )


def snapshot(mgr: CacheManager) -> dict[str, Any]:
    seqs = {
        repr(rid): (
            bytes(s.tokens),
            s.num_tokens,
            list(s.table),
            list(s.private),
            s.blocked,
            s.unconfirmed,
            list(s.pending),
            s.pending_start,
            mgr.index.path_blocks(s.deepest),
            None if s.copy_source is None else mgr.index.path_blocks(s.copy_source),
        )
        for rid, s in mgr.internals.states.items()
    }
    return {
        "trees": sorted((repr(ns), _node(root)) for ns, root in mgr.index.roots.items()),
        "counts": (mgr.index.num_blocks, mgr.index.active_blocks, mgr.index.num_nodes),
        "tenants": (dict(mgr.index.tenant_blocks), mgr.tenant_stats(), mgr.shares),
        "free": mgr.pool.free_ids(),
        "refcount": sorted(mgr.pool.refcount.items()),
        "seqs": seqs,
        "pins": {h: mgr.index.path_blocks(n) for h, n in mgr.internals.pins.items()},
        "pending": sorted(mgr.internals.pending_blocks),
        "step_holds": (
            [mgr.index.path_blocks(n) for n in mgr.internals.step_holds[0]],
            mgr.internals.step_holds[1],
        ),
        "stats": mgr.stats.as_dict(),
        "tick": mgr.internals.clock_ticks,
        "host": _host(mgr),
    }


def _host(mgr: CacheManager) -> Any:
    host = mgr.host
    if host is None:
        return None
    entries = sorted(
        (d, e.slot, e.parent, e.tokens, e.position, repr(e.namespace), e.stamp)
        for d, e in host.entries.items()
    )
    return entries, host.free_slots(), list(host.deferred), sorted(host.leaf_records())
