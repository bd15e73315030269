"""Full invariant check of a CacheManager (DESIGN.md invariants 1-4 and 6), for tests."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.hashing import DIGEST_SIZE as D

if TYPE_CHECKING:
    from prefixcache.manager import CacheManager
    from prefixcache.radix import Node


class IntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


def check_manager(mgr: CacheManager) -> None:
    index, pool, p = mgr.index, mgr.pool, mgr.block_size
    bb = 4 * p
    tree_blocks: list[int] = []
    expected_ref: Counter[int] = Counter()
    holders = [s.deepest for s in mgr._seqs.values()] + list(mgr._pins.values())
    holders += [s.copy_source for s in mgr._seqs.values() if s.copy_source is not None]
    for node in holders:
        while node.parent is not None:
            expected_ref[id(node)] += 1
            node = node.parent
    nodes = active = 0
    for root in index.roots.values():
        _require(root.parent is None and len(root.blocks) == 0, "root holds blocks")
        _require(root.namespace is not None, "root without a namespace")
        assert root.namespace is not None
        _require(bytes(root.digests) == mgr.hasher.seed(root.namespace), "root seed is wrong")
        stack: list[Node] = [root]
        while stack:
            node = stack.pop()
            for key, child in (node.children or {}).items():
                _require(child.parent is node, "child's parent link is wrong")
                _require(bytes(child.digests[:D]) == key, "child keyed by a wrong digest")
                _require(node.by_token is not None, "children without a token map")
                stack.append(child)
            for tok, child in (node.by_token or {}).items():
                _require(
                    child.parent is node and int.from_bytes(child.tokens[:4], "little") == tok,
                    "token map points at a wrong child",
                )
            if node.parent is None:
                continue
            n = len(node.blocks)
            nodes += 1
            _require(n > 0, "empty non-root node")
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
            prev = bytes(parent.digests[-D:])
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
    for seq in mgr._seqs.values():
        private_refs.update(seq.private)
    free = pool.free_ids()
    private = [b for b in range(pool.num_blocks) if pool.refcount[b] > 0]
    _require(len(set(free)) == len(free), "free list holds a block twice")
    _require(len(set(tree_blocks)) == len(tree_blocks), "a block is in the index twice")
    everything = set(free) | set(tree_blocks) | set(private)
    _require(
        len(free) + len(tree_blocks) + len(private) == pool.num_blocks == len(everything),
        "blocks are leaked or in two states",
    )
    for b in private:
        _require(pool.refcount[b] == private_refs[b], f"private block {b} refcount is wrong")
    _require(set(private_refs) == set(private), "a request lists a block it does not own")
    _require(len(private) == pool.num_private, "private block count is wrong")
    counts = mgr.block_counts()
    _require(counts.total == pool.num_blocks, "block states do not add up")

    for rid, seq in mgr._seqs.items():
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
        while node.parent is not None:
            _require(
                bytes(node.tokens) == want[node.depth * bb : node.end * bb],
                f"{rid!r}: holds a cached block whose tokens differ",
            )
            node = node.parent
