"""Full invariant check of a manager's state (the invariants of docs/architecture.md), for
tests: ``CacheManager.check_integrity``."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.blocks.hashing import DIGEST_SIZE as D
from prefixcache.blocks.radix import TokenGroup

if TYPE_CHECKING:
    from prefixcache.blocks.radix import Node
    from prefixcache.manager.state import CacheState


class IntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


def check_state(state: CacheState) -> None:
    """Raise IntegrityError at the first invariant the manager's state breaks."""
    _check_gpu(state)
    check_host_tier(state)


def _check_tenants(state: CacheState) -> None:
    """With tenant shares: every evictable leaf is filed in its tenant's heap (or the common
    one), the counters are not negative, and the shares still fit the pool."""
    shares = state.shares()
    if shares is None:
        return
    evictor = state.evictor
    _require(sum(s.guaranteed for s in shares.values()) <= state.num_blocks, "guarantees overflow")
    for tenant, row in state.tenant_stats().items():
        _require(min(row[3:]) >= 0, f"tenant {tenant!r} has a negative counter")
        _require(row.evicted_by_others <= row.evicted_blocks, "more evicted by others than all")
    heaps = getattr(evictor, "heaps", {})
    filed = {tenant: heap.filed_ids() for tenant, heap in heaps.items()}
    common = evictor.filed_ids()
    for node in state.index.iter_nodes():
        if not evictor.evictable(node):
            continue
        assert node.namespace is not None
        salt = node.namespace.salt
        ids = filed.get(salt, common) if salt else common
        _require(id(node) in ids, "an evictable leaf is not filed in its tenant's eviction heap")


def _check_gpu(state: CacheState) -> None:
    index, pool, p = state.index, state.pool, state.block_size
    bb = 4 * p
    tree_blocks: list[int] = []
    expected_ref: Counter[int] = Counter()
    states, pins = state.seqs, state.pins
    holders = [s.deepest for s in states.values()] + list(pins.values())
    holders += [s.copy_source for s in states.values()]
    step_nodes, step_refs = [node for node, _ in state.holds], state.refs
    holders += step_nodes
    for node in holders:
        while node is not None and node.parent is not None:
            expected_ref[id(node)] += 1
            node = node.parent
    nodes = active = 0
    tenant_blocks: Counter[str | None] = Counter()
    for root in index.roots.values():
        _require(root.parent is None and len(root.blocks) == 0, "root holds blocks")
        _require(root.namespace is not None, "root without a namespace")
        _require(
            bool(root.children or root.host_children), "a namespace root without children is kept"
        )
        assert root.namespace is not None
        _require(bytes(root.digests) == state.hasher.seed(root.namespace), "root seed is wrong")
        stack: list[Node] = [root]
        while stack:
            node = stack.pop()
            for key, child in (node.children or {}).items():
                _require(child.parent is node, "child's parent link is wrong")
                _require(child.digest(0) == key, "child keyed by a wrong digest")
                stack.append(child)
            filed: list[Node] = []
            for tok, group in (node.by_token or {}).items():
                members = group.nodes() if isinstance(group, TokenGroup) else [group]
                _require(
                    len(members) > 0 and not (isinstance(group, TokenGroup) and len(members) < 2),
                    "a token group of fewer than two is kept as a group",
                )
                firsts = [index.block_tokens(c, 0) for c in members]
                _require(firsts == sorted(firsts), "a token group is not in token order")
                if isinstance(group, TokenGroup):
                    _require(group.keys() == firsts, "a token group's keys differ from its blocks")
                    problem = group.check()
                    _require(problem is None, str(problem))
                _require(
                    all(int.from_bytes(f[:4], "little") == tok for f in firsts),
                    "a child is filed under another token",
                )
                filed += members
            _require(
                sorted(map(id, filed)) == sorted(id(c) for c in (node.children or {}).values()),
                "the token map differs from the children",
            )
            _require((node.children is None) == (node.by_token is None), "empty maps are kept")
            if node.parent is None:
                continue
            n = len(node.blocks)
            nodes += 1
            _require(n > 0, "empty non-root node")
            _require(node.namespace is root.namespace, "a node names another namespace")
            _require(
                len(node.digests) == n * D and len(node.tokens) == n * bb, "run lengths differ"
            )
            parent = node.parent
            _require(node.depth == (parent.end if parent.parent is not None else 0), "bad depth")
            _require(
                node.ref == expected_ref[id(node)],
                f"node ref {node.ref} but {expected_ref[id(node)]} holders",
            )
            _require(
                sum(c.ref for c in (node.children or {}).values()) <= node.ref,
                "children hold more than their parent",
            )
            _require(not node.on_host, "a host node is among GPU children")
            _require(_chain_holds(state, node), "stored digest breaks the chain")
            tree_blocks.extend(node.blocks)
            assert node.namespace is not None
            tenant_blocks[node.namespace.salt] += n
            if node.ref:
                active += n
    _require(nodes == index.num_nodes, f"num_nodes {index.num_nodes} != {nodes}")
    _require(len(tree_blocks) == index.num_blocks, "index block count is wrong")
    _require(active == index.active_blocks, f"active count {index.active_blocks} != {active}")
    _require(
        dict(tenant_blocks) == index.tenant_blocks,
        f"tenant block counts {index.tenant_blocks} != {dict(tenant_blocks)}",
    )
    _check_tenants(state)

    private_refs: Counter[int] = Counter()
    for seq in states.values():
        private_refs.update(seq.private)
    private_refs.update(step_refs)
    free = pool.returned_ids()  # the never-used blocks, handed_out and up, are not listed
    private = list(pool.refcount)
    used = pool.handed_out
    _require(0 <= used <= pool.num_blocks, f"{used} blocks handed out of {pool.num_blocks}")
    _require(len(set(free)) == len(free), "free list holds a block twice")
    _require(len(set(tree_blocks)) == len(tree_blocks), "a block is in the index twice")
    everything = set(free) | set(tree_blocks) | set(private)
    _require(
        len(free) + len(tree_blocks) + len(private) == used == len(everything),
        "blocks are leaked or in two states",
    )
    _require(all(0 <= b < used for b in everything), "a block id was never handed out")
    for b in private:
        _require(pool.refcount[b] > 0, f"private block {b} has no owner")
        _require(pool.refcount[b] == private_refs[b], f"private block {b} refcount is wrong")
    _require(set(private_refs) == set(private), "a request lists a block it does not own")
    counts = state.block_counts()
    _require(counts.total == pool.num_blocks, "block states do not add up")

    tree_set = set(tree_blocks)
    pending = state.pending_blocks()
    _require(pending <= tree_set, "a pending block is not in the index")
    own: list[int] = []
    for rid, seq in states.items():
        own += seq.pending
        _require(seq.unconfirmed or not seq.pending, f"{rid!r}: confirmed but has pending blocks")
        _require(
            (seq.pending_start is None) == (not seq.pending), f"{rid!r}: pending start is wrong"
        )
        if seq.pending_start is not None:
            tail = set(index.path_blocks(seq.deepest)[seq.pending_start :])
            _require(set(seq.pending) <= tail, f"{rid!r}: a pending block is not on its path")
    _require(len(own) == len(set(own)), "a block is pending for two requests")
    if not state.stepped:
        _require(not step_nodes and not step_refs, "step holds without steps")
    for handle, node in pins.items():
        _require(
            not pending & set(index.path_blocks(node)), f"pin {handle} covers unwritten blocks"
        )

    for rid, seq in states.items():
        _require(len(seq.table) == -(-seq.num_tokens // p), f"{rid!r}: table length is wrong")
        _require(set(seq.private) <= set(seq.table), f"{rid!r}: private block not in table")
        _require(len(set(seq.private)) == len(seq.private), f"{rid!r}: private block twice")
        path = state.index.path_blocks(seq.deepest)
        _require(len(path) <= seq.num_tokens // p, f"{rid!r}: path longer than its full blocks")
        for i, b in enumerate(seq.table):
            if i >= len(path) or b != path[i]:
                _require(b in seq.private, f"{rid!r}: block {i} neither on its path nor private")
        # exactness: the path's stored tokens are the request's tokens (no wrong hit is served)
        node, want = seq.deepest, bytes(seq.tokens)
        while node is not None and node.parent is not None:
            _require(
                bytes(node.tokens) == want[node.depth * bb : node.end * bb],
                f"{rid!r}: holds a cached block whose tokens differ",
            )
            node = node.parent


def _chain_holds(state: CacheState, node: Node) -> bool:
    """Whether the node's digests are those of its tokens, chained from its parent's last."""
    assert node.parent is not None
    p = state.block_size
    tokens = np.frombuffer(bytes(node.tokens), dtype="<i4")
    digests = state.hasher.hash_blocks(
        np.concatenate([np.zeros(node.depth * p, dtype="<i4"), tokens]),
        node.parent.last_digest(),
        node.depth,
        node.end,
    )
    return b"".join(digests) == bytes(node.digests)


def check_host_tier(state: CacheState) -> None:
    """The host tier's invariants: host nodes' links, places and chains, exclusivity with the
    GPU's blocks, slots, the block count, stamps and the leaf LRU."""
    host = state.host
    if host is None:
        return
    _require(host.index is state.index, "the host tier works on another index")
    bb = state.index.block_bytes
    used: list[int] = []
    stamps: list[int] = []
    leaves: list[Node] = []
    for root in state.index.roots.values():
        stack: list[Node] = [root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            kids = node.host_children
            if kids is not None:
                _require(bool(kids), "an empty host children map is kept")
                _require(
                    not (node.children and kids.keys() & node.children.keys()),
                    "a block is both on the GPU and on host",
                )
                end = node.end if node.parent is not None else 0
                for key, child in kids.items():
                    _require(child.on_host, "a GPU node hangs among host children")
                    _require(child.parent is node, "a host node's parent link is wrong")
                    _require(child.digest(0) == key, "a host node is keyed by a wrong digest")
                    _require(child.depth == end, "a host node does not continue its parent")
                    _require(
                        child.namespace is root.namespace, "a host node names another namespace"
                    )
                    stack.append(child)
            if not node.on_host:
                continue
            n = len(node.blocks)
            _require(n > 0, "an empty host node")
            _require(
                node.children is None and node.by_token is None, "a host node has GPU children"
            )
            _require(node.ref == 0, "a host node is held")
            _require(
                len(node.digests) == n * D and len(node.tokens) == n * bb, "run lengths differ"
            )
            _require(_chain_holds(state, node), "a host block's digest breaks the chain")
            used.extend(node.blocks)
            stamps.extend(range(node.stamp, node.stamp + n))
            if not kids:
                leaves.append(node)
    _require(len(used) == host.num_blocks, f"host block count {host.num_blocks} != {len(used)}")
    slots = used + host.free_slots() + host.deferred
    _require(len(slots) == host.capacity, "host slots are leaked or counted twice")
    _require(set(slots) == set(range(host.capacity)), "host slots are leaked or in two states")
    if not state.stepped:
        _require(not host.deferred, "deferred host slots without steps")
    _require(len(set(stamps)) == len(stamps), "two host blocks share a stamp")
    _require(all(0 < s <= host.last_stamp for s in stamps), "a host block's stamp is not given")
    records = host.leaf_records()
    for leaf in leaves:
        record = (leaf.stamp + len(leaf.blocks) - 1, id(leaf))
        _require(record in records, "a host leaf is missing from the LRU")
