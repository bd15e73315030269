"""Full invariant check of a CacheManager (the invariants of docs/architecture.md), for tests."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.blocks.hashing import DIGEST_SIZE as D
from prefixcache.blocks.radix import TokenGroup

if TYPE_CHECKING:
    from prefixcache.blocks.radix import Node
    from prefixcache.manager.cache_manager import CacheManager


class IntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


def check_manager(mgr: CacheManager) -> None:
    """Raise IntegrityError at the first invariant the manager's state breaks."""
    _check_gpu(mgr)
    check_host_tier(mgr)


def _check_gpu(mgr: CacheManager) -> None:
    index, pool, p = mgr.index, mgr.pool, mgr.block_size
    bb = 4 * p
    tree_blocks: list[int] = []
    expected_ref: Counter[int] = Counter()
    states, pins = mgr.states, mgr.pins
    holders = [s.deepest for s in states.values()] + list(pins.values())
    holders += [s.copy_source for s in states.values()]
    step_nodes, step_refs = mgr.step_holds
    holders += step_nodes
    for node in holders:
        while node is not None and node.parent is not None:
            expected_ref[id(node)] += 1
            node = node.parent
    nodes = active = 0
    for root in index.roots.values():
        _require(root.parent is None and len(root.blocks) == 0, "root holds blocks")
        _require(root.namespace is not None, "root without a namespace")
        _require(bool(root.children), "a namespace root without children is kept")
        assert root.namespace is not None
        _require(bytes(root.digests) == mgr.hasher.seed(root.namespace), "root seed is wrong")
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
            prev = parent.last_digest()
            tokens = np.frombuffer(bytes(node.tokens), dtype="<i4")
            digests = mgr.hasher.hash_blocks(
                np.concatenate([np.zeros(node.depth * p, dtype="<i4"), tokens]),
                prev,
                node.depth,
                node.end,
            )
            _require(b"".join(digests) == bytes(node.digests), "stored digest breaks the chain")
            tree_blocks.extend(node.blocks)
            if node.ref:
                active += n
    _require(nodes == index.num_nodes, f"num_nodes {index.num_nodes} != {nodes}")
    _require(len(tree_blocks) == index.num_blocks, "index block count is wrong")
    _require(active == index.active_blocks, f"active count {index.active_blocks} != {active}")

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
    counts = mgr.block_counts()
    _require(counts.total == pool.num_blocks, "block states do not add up")

    tree_set = set(tree_blocks)
    pending = mgr.pending_blocks
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
    if not mgr.stepped:
        _require(not step_nodes and not step_refs, "step holds without steps")
    for handle, node in pins.items():
        _require(
            not pending & set(index.path_blocks(node)), f"pin {handle} covers unwritten blocks"
        )

    for rid, seq in states.items():
        _require(len(seq.table) == -(-seq.num_tokens // p), f"{rid!r}: table length is wrong")
        _require(set(seq.private) <= set(seq.table), f"{rid!r}: private block not in table")
        _require(len(set(seq.private)) == len(seq.private), f"{rid!r}: private block twice")
        path = mgr.index.path_blocks(seq.deepest)
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


def check_host_tier(mgr: CacheManager) -> None:
    """The host tier's invariants: slots, children maps, the leaf LRU, prefix closure and
    exclusivity with the GPU index."""
    host = mgr.host
    if host is None:
        return
    entries = host.entries
    used = [e.slot for e in entries.values()]
    free = host.free_slots()
    slots = used + free + host.deferred
    _require(len(slots) == host.capacity, "host slots are leaked or counted twice")
    _require(set(slots) == set(range(host.capacity)), "host slots are leaked or in two states")
    if not mgr.stepped:
        _require(not host.deferred, "deferred host slots without steps")
    gpu: set[bytes] = set()
    for node in mgr.index.iter_nodes():
        gpu.update(node.digest(i) for i in range(len(node.blocks)))
    _require(not gpu & entries.keys(), "a block is both in the GPU index and on host")
    expected: dict[bytes, set[bytes]] = {}
    bb = 4 * mgr.block_size
    for digest, entry in entries.items():
        expected.setdefault(entry.parent, set()).add(digest)
        _require(len(entry.tokens) == bb, "a host block's tokens have the wrong length")
        want = mgr.hasher.hash_block(entry.parent, entry.position, entry.tokens)
        _require(want == digest, "a host block's digest breaks the chain")
        seed = mgr.hasher.seed(entry.namespace)
        if entry.position == 0:
            _require(entry.parent == seed, "a first host block's parent is not its seed")
        else:
            _require(
                entry.parent in gpu or entry.parent in entries,
                "a host block's parent is neither on the GPU nor on host",
            )
            up = entries.get(entry.parent)
            if up is not None:
                _require(
                    up.namespace == entry.namespace and up.position == entry.position - 1,
                    "a host block's parent is of another chain",
                )
    _require(host.children == expected, "host children maps are inconsistent")
    records = host.leaf_records()
    for digest, entry in entries.items():
        if digest not in host.children:
            _require((entry.stamp, digest) in records, "a host leaf is missing from the LRU")
