"""Radix index over full blocks: one tree per namespace, path-compressed, split on divergence.

A node holds a run of consecutive full blocks (their digests, token ids and physical ids). Children
are keyed by the digest of their first block, so a lookup costs one hash and one dict probe per
node; a digest match is then confirmed by comparing token ids, so a collision never serves a
wrong block. A request holds every node from the root down to its deepest one (``ref`` counts the
holders), which keeps the held set, like the cached set, prefix-closed. A namespace's root exists
only while it has children (on the GPU or on host).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from typing import Final, NamedTuple

from prefixcache.blocks.hashing import DIGEST_SIZE, BlockHasher
from prefixcache.blocks.namespace import Namespace

D: Final = DIGEST_SIZE
# builds a NamedTuple from a tuple in C (the generated __new__ is a Python call): hot paths only
_new = tuple.__new__
# a node grows in place up to this many blocks, then a child takes over
MAX_GROW_BLOCKS: Final = 256
GROUP_BUCKET: Final = 64  # a token group's buckets hold 1 to 2 * this many siblings


class TokenGroup:
    """Siblings whose first blocks start with the same token, in the order of their first
    block's token bytes (the keys). Siblings differ within their first block, and a node keeps
    its first block until it leaves the tree, so the order never changes; the two neighbours of
    a query in it share the longest prefix with the query.

    A prompt that diverges inside a block (a system prompt that is not a whole number of
    blocks, followed by each request's own text) files every request's branch in one group, so
    a group can hold as many nodes as the cache. The order is kept in buckets of at most
    ``2 * bucket`` entries with each bucket's first key beside them: adding or removing a node
    moves at most one bucket's entries, not the whole group's. A bucket that falls under half
    joins a neighbour it fits with, so removals do not leave a trail of small buckets.
    """

    __slots__ = ("bucket", "firsts", "key_buckets", "node_buckets")

    def __init__(self, keys: list[bytes], nodes: list[Node], bucket: int = GROUP_BUCKET) -> None:
        assert len(keys) == len(nodes) > 0 and bucket > 0
        self.bucket = bucket
        self.key_buckets = [keys[i : i + bucket] for i in range(0, len(keys), bucket)]
        self.node_buckets = [nodes[i : i + bucket] for i in range(0, len(nodes), bucket)]
        self.firsts = [keys[0] for keys in self.key_buckets]  # each bucket's first key

    def __len__(self) -> int:
        return sum(map(len, self.key_buckets))

    def _locate(self, key: bytes | bytearray) -> tuple[int, int]:
        """(bucket, index in it) where ``key`` would go: before every key >= it."""
        b = bisect_right(self.firsts, key) - 1
        if b < 0:
            return 0, 0
        return b, bisect_left(self.key_buckets[b], key)

    def add(self, key: bytes, node: Node) -> None:
        b, i = self._locate(key)
        keys, nodes = self.key_buckets[b], self.node_buckets[b]
        keys.insert(i, key)
        nodes.insert(i, node)
        if i == 0:
            self.firsts[b] = key
        if len(keys) > 2 * self.bucket:  # split the bucket in two
            half = len(keys) // 2
            self.key_buckets.insert(b + 1, keys[half:])
            self.node_buckets.insert(b + 1, nodes[half:])
            self.firsts.insert(b + 1, keys[half])
            del keys[half:], nodes[half:]

    def position(self, node: Node, key: bytes | bytearray) -> tuple[int, int]:
        """Where ``node``, whose first block's tokens are ``key``, is filed."""
        b, i = self._locate(key)
        assert self.node_buckets[b][i] is node
        return b, i

    def replace(self, node: Node, key: bytes | bytearray, other: Node) -> None:
        """File ``other`` in ``node``'s place (it starts with the same block)."""
        b, i = self.position(node, key)
        self.node_buckets[b][i] = other

    def remove(self, node: Node, key: bytes | bytearray) -> None:
        b, i = self.position(node, key)
        keys = self.key_buckets[b]
        del keys[i], self.node_buckets[b][i]
        if not keys:
            del self.key_buckets[b], self.node_buckets[b], self.firsts[b]
            return
        if i == 0:
            self.firsts[b] = keys[0]
        if 2 * len(keys) < self.bucket:  # under half: join a neighbour it fits with
            limit = 2 * self.bucket - len(keys)
            if b + 1 < len(self.key_buckets) and len(self.key_buckets[b + 1]) <= limit:
                self._merge(b)
            elif b > 0 and len(self.key_buckets[b - 1]) <= limit:
                self._merge(b - 1)

    def _merge(self, b: int) -> None:
        """Bucket ``b + 1`` joins bucket ``b``."""
        self.key_buckets[b] += self.key_buckets[b + 1]
        self.node_buckets[b] += self.node_buckets[b + 1]
        del self.key_buckets[b + 1], self.node_buckets[b + 1], self.firsts[b + 1]

    def only(self) -> Node | None:
        """The one node left, or None while there are more."""
        nodes = self.node_buckets
        return nodes[0][0] if len(nodes) == 1 and len(nodes[0]) == 1 else None

    def neighbours(self, query: bytes) -> tuple[tuple[bytes, Node], tuple[bytes, Node] | None]:
        """The (key, node) just before ``query`` in the order and the one at or after it; the
        first entry when nothing comes before, and None for the second when nothing or only
        that first entry comes after."""
        b, i = self._locate(query)
        keys, nodes = self.key_buckets[b], self.node_buckets[b]
        if i == 0 and b == 0:
            return (keys[0], nodes[0]), None
        if i > 0:
            before = keys[i - 1], nodes[i - 1]
        else:
            before = self.key_buckets[b - 1][-1], self.node_buckets[b - 1][-1]
        if i < len(keys):
            return before, (keys[i], nodes[i])
        if b + 1 < len(self.key_buckets):
            return before, (self.key_buckets[b + 1][0], self.node_buckets[b + 1][0])
        return before, None

    def keys(self) -> list[bytes]:
        """Every key, in order."""
        return [key for keys in self.key_buckets for key in keys]

    def nodes(self) -> list[Node]:
        """Every node, in the keys' order."""
        return [node for nodes in self.node_buckets for node in nodes]

    def check(self) -> str | None:
        """What is wrong with the buckets' bookkeeping, or None."""
        buckets = len(self.key_buckets)
        if len(self.node_buckets) != buckets or len(self.firsts) != buckets:
            return "a token group's bucket lists differ in length"
        for keys, nodes, first in zip(
            self.key_buckets, self.node_buckets, self.firsts, strict=True
        ):
            if not keys or len(keys) != len(nodes) or len(keys) > 2 * self.bucket:
                return "a token group has an empty, uneven or oversized bucket"
            if keys[0] != first:
                return "a token group's bucket is filed under a wrong first key"
        return None


def common_tokens(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Number of leading int32 tokens two equally long LE token buffers share."""
    if a == b:
        return len(a) // 4
    x = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    return ((x & -x).bit_length() - 1) // 32  # lowest differing bit -> its token


class Node:
    """A run of full blocks. The root of a namespace has no blocks; its ``digests`` is the seed.

    A GPU node's ``children`` are GPU nodes; blocks offloaded to host stay in the tree as host
    nodes, under ``host_children`` (host_tier.py), which nothing on the GPU side walks.

    Buffers are bytearrays so that trimming the tail (eviction) costs what it removes.
    """

    __slots__ = (
        "blocks",
        "by_token",
        "children",
        "depth",
        "digests",
        "heap_token",
        "hits",
        "host_children",
        "last_access",
        "later",
        "namespace",
        "on_host",
        "parent",
        "priority",
        "ref",
        "retain_until",
        "stamp",
        "tokens",
    )

    def __init__(
        self,
        parent: Node | None,
        depth: int,
        digests: bytearray | None = None,
        tokens: bytearray | None = None,
        blocks: array[int] | None = None,
    ) -> None:
        self.parent = parent
        self.depth = depth  # blocks before this node's first block
        self.children: dict[bytes, Node] | None = None  # first block's digest -> child
        # first token -> the child, or the children that start with it in token order
        self.by_token: dict[int, Node | TokenGroup] | None = None
        self.digests = bytearray() if digests is None else digests  # 16 bytes per block
        self.tokens = bytearray() if tokens is None else tokens  # block_size int32 LE per block
        self.blocks = array("i") if blocks is None else blocks  # physical block ids
        self.ref = 0
        self.last_access = 0.0
        self.hits = 0
        self.priority = 0
        self.retain_until = 0.0
        # lower-priority claims that outlive the one above, as (priority, until), highest first
        self.later: tuple[tuple[int, float], ...] = ()
        self.heap_token = 0
        self.namespace: Namespace | None = None  # of its tree (set when it joins one)
        # the host tier's nodes that continue this one's last block, by their first digest
        self.host_children: dict[bytes, Node] | None = None
        self.on_host = False  # a host node: ``blocks`` are host slots (see host_tier.py)
        self.stamp = 0  # a host node: the store order of its first block (one per block)

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, blocks={list(self.blocks)}, ref={self.ref})"

    @property
    def end(self) -> int:
        """Index of the block after this node's last one."""
        return self.depth + len(self.blocks)

    def digest(self, i: int) -> bytes:
        """Digest of the node's ``i``-th block (-1: the last; the seed on a root)."""
        if i < 0:
            i += len(self.digests) // D
        return bytes(self.digests[i * D : (i + 1) * D])

    def last_digest(self) -> bytes:
        return self.digest(-1)


class MatchResult(NamedTuple):
    """The longest cached prefix of a sequence's full blocks."""

    node: Node  # where the match ends (the root when nothing matched)
    j: int  # matched blocks inside ``node`` (``j < len(node.blocks)``: the match stops mid-node)
    n: int  # matched blocks in all
    digest: bytes  # h_{n-1}: the digest of the last matched block (the seed when n == 0)


class PartialMatch(NamedTuple):
    """A cached block whose first ``m`` tokens equal the start of a sequence's next block."""

    node: Node  # its first block is the one to copy from
    m: int


class RadixIndex:
    """The trees of all namespaces plus the counts the pool's state accounting needs."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.block_bytes = 4 * hasher.block_size
        self.roots: dict[Namespace, Node] = {}
        self.num_blocks = 0  # blocks in any tree
        self.active_blocks = 0  # blocks in trees whose node has ref > 0
        self.num_nodes = 0
        # blocks in the trees of each tenant (a namespace's salt; None: no salt), never 0
        self.tenant_blocks: dict[str | None, int] = {}

    def count_tenant(self, node: Node, delta: int) -> None:
        """``delta`` blocks join (or, negative, leave) the trees of ``node``'s tenant."""
        namespace = node.namespace
        assert namespace is not None
        tenant = namespace.salt
        counts = self.tenant_blocks
        n = counts.get(tenant, 0) + delta
        if n:
            counts[tenant] = n
        else:
            del counts[tenant]

    # ---- per-node accessors ---------------------------------------------------------------
    def block_tokens(self, node: Node, i: int) -> bytes:
        """The int32 LE token bytes of the node's ``i``-th block."""
        bb = self.block_bytes
        return bytes(node.tokens[i * bb : (i + 1) * bb])

    def _group_add(self, parent: Node, node: Node, token: int, key: bytes) -> None:
        """File ``node`` (first block's tokens ``key``) under its first token next to siblings
        that start with it too."""
        assert parent.by_token is not None
        group = parent.by_token[token]
        if isinstance(group, TokenGroup):
            group.add(key, node)
        else:
            other = bytes(group.tokens[: self.block_bytes])
            pair = [(other, group), (key, node)] if other < key else [(key, node), (other, group)]
            parent.by_token[token] = TokenGroup([k for k, _ in pair], [n for _, n in pair])

    # ---- lookup ---------------------------------------------------------------------------
    def root(self, namespace: Namespace) -> Node:
        """The namespace's root, created on demand."""
        node = self.roots.get(namespace)
        if node is None:
            node = Node(None, 0)
            node.digests = bytearray(self.hasher.seed(namespace))
            node.namespace = namespace
            self.roots[namespace] = node
        return node

    def match(
        self, root: Node, buf: bytes, num_full: int, digests: list[bytes] | None = None
    ) -> MatchResult:
        """Longest cached prefix of the first ``num_full`` blocks of ``buf`` (``digests``: their
        digests, when the caller has them). Read-only."""
        bb = self.block_bytes
        hash_digest = self.hasher.digest
        starts = self.hasher.block_starts(num_full)
        node, j, n = root, 0, 0
        digest = bytes(root.digests)
        while n < num_full:
            children = node.children
            if not children:
                break
            if digests is not None:
                child = children.get(digests[n])
            else:
                child = children.get(hash_digest(digest + starts[n] + buf[n * bb : (n + 1) * bb]))
            if child is None:
                break
            k = len(child.blocks)
            if k <= num_full - n and buf.startswith(child.tokens, n * bb):  # the whole node
                m = k
            else:
                m = self.common_blocks(child, buf, n, min(k, num_full - n))
            if m == 0:  # digest collision on the first block: not a hit
                break
            node, j, n = child, m, n + m
            digest = bytes(child.digests[(m - 1) * D : m * D])
            if m < len(child.blocks):
                break
        return _new(MatchResult, (node, j, n, digest))

    def common_blocks(self, node: Node, buf: bytes | bytearray, start: int, k: int) -> int:
        """How many of the node's first ``k`` blocks equal the sequence's from block ``start``."""
        bb = self.block_bytes
        same = common_tokens(node.tokens[: k * bb], buf[start * bb : (start + k) * bb])
        return same // self.block_size

    def path_blocks(self, node: Node | None) -> list[int]:
        """Physical ids of every block from the root down to the end of ``node``."""
        runs = []
        while node is not None and node.parent is not None:
            runs.append(node.blocks)
            node = node.parent
        out: list[int] = []
        for run in reversed(runs):
            out.extend(run)
        return out

    def partial_match(self, match: MatchResult, buf: bytes, limit: int) -> PartialMatch | None:
        """The cached block that shares the most (at most ``limit``, at least 1) leading tokens
        with the sequence's block ``match.n``, the first one not matched in full.

        Where the match stops inside a node, that node's next block is the only candidate (its
        siblings' first blocks differ from the matched one); otherwise the children of the
        matched node are searched in token order, whose two neighbours of the query share the
        longest prefix with it.
        """
        node, j = match.node, match.j
        start = match.n * self.block_bytes
        query = buf[start : start + 4 * limit]
        if j < len(node.blocks):  # the match ended inside the node
            bb = self.block_bytes
            m = common_tokens(node.tokens[j * bb : j * bb + 4 * limit], query)
            return _new(PartialMatch, (node, m)) if m > 0 else None
        group = node.by_token.get(int.from_bytes(query[:4], "little")) if node.by_token else None
        if group is None:  # no child starts with the same token
            return None
        width = len(query)
        if not isinstance(group, TokenGroup):
            m = common_tokens(group.tokens[:width], query)
            return _new(PartialMatch, (group, m)) if m > 0 else None
        # the two neighbours of the query in token order share the most with it
        (key, best), after = group.neighbours(query)
        best_m = common_tokens(key[:width], query)
        if after is not None:
            key, node = after
            m = common_tokens(key[:width], query)
            if m > best_m or (m == best_m and node.last_access > best.last_access):
                best, best_m = node, m  # the longer match; on a tie the more recent block
        return _new(PartialMatch, (best, best_m)) if best_m > 0 else None

    # ---- structure ------------------------------------------------------------------------
    def split(self, node: Node, j: int) -> Node:
        """Split ``node`` after ``j`` blocks; returns the new upper node. ``node`` keeps the rest
        (and its identity, so holders that point at it stay valid)."""
        parent = node.parent
        assert parent is not None and parent.children is not None and parent.by_token is not None
        assert 0 < j < len(node.blocks)
        bb = self.block_bytes
        tokens, digests = node.tokens, node.digests
        token = int.from_bytes(tokens[:4], "little")
        group = parent.by_token[token]
        upper = Node(parent, node.depth, digests[: j * D], tokens[: j * bb], node.blocks[:j])
        if isinstance(group, TokenGroup):  # same first block, same place in the order
            group.replace(node, upper.tokens[:bb], upper)
        else:
            parent.by_token[token] = upper
        del digests[: j * D]
        del tokens[: j * bb]
        del node.blocks[:j]
        upper.ref, upper.last_access, upper.hits = node.ref, node.last_access, node.hits
        upper.priority, upper.retain_until = node.priority, node.retain_until
        upper.later = node.later
        upper.namespace = node.namespace
        parent.children[bytes(upper.digests[:D])] = upper
        upper.children = {bytes(digests[:D]): node}
        upper.by_token = {int.from_bytes(tokens[:4], "little"): node}
        node.parent = upper
        node.depth += j
        self.num_nodes += 1
        return upper

    def add(
        self,
        parent: Node,
        digests: list[bytes],
        tokens: bytes | bytearray,
        blocks: list[int],
        now: float,
    ) -> Node:
        """Store a run of blocks after ``parent``, held once by the caller.

        Extends ``parent`` in place when the caller is its only holder and it is a leaf, so a
        growing sequence keeps few nodes; otherwise (or once the node is long) adds a child.
        """
        if (
            parent.parent is not None
            and parent.ref == 1
            and not parent.children
            and not parent.host_children  # host blocks continue its last block
            and len(parent.blocks) < MAX_GROW_BLOCKS
        ):
            node = parent
            node.digests += b"".join(digests)
            node.tokens += tokens
            node.blocks.extend(blocks)
        else:
            node = Node(
                parent,
                parent.end if parent.parent is not None else 0,
                bytearray(b"".join(digests)),
                bytearray(tokens),
                array("i", blocks),
            )
            node.ref = 1
            node.namespace = parent.namespace
            if parent.children is None or parent.by_token is None:
                parent.children, parent.by_token = {}, {}
            parent.children[digests[0]] = node
            token = int.from_bytes(tokens[:4], "little")
            if token in parent.by_token:
                self._group_add(parent, node, token, bytes(tokens[: self.block_bytes]))
            else:  # the usual case: the first child with this first token
                parent.by_token[token] = node
            self.num_nodes += 1
        node.last_access = now
        self.num_blocks += len(blocks)
        self.active_blocks += len(blocks)
        self.count_tenant(node, len(blocks))
        return node

    def hold(
        self, node: Node | None, now: float, *, hit: bool = False, upto: Node | None = None
    ) -> None:
        """Take one reference on every node from ``node`` up to the root, or up to (not
        including) ``upto`` when the caller already holds that one. ``hit``: count a hit."""
        while node is not None and node is not upto and node.parent is not None:
            if node.ref == 0:
                self.active_blocks += len(node.blocks)
            node.ref += 1
            node.last_access = now
            node.hits += hit
            node = node.parent

    def hold_table(self, node: Node | None, now: float) -> list[int]:
        """``hold(node, now, hit=True)`` and ``path_blocks(node)`` in one walk: a hit on the
        path from the root to ``node``, and the physical ids of its blocks."""
        runs = []
        active = 0
        while node is not None and node.parent is not None:
            if node.ref == 0:
                active += len(node.blocks)
            node.ref += 1
            node.last_access = now
            node.hits += 1
            runs.append(node.blocks)
            node = node.parent
        self.active_blocks += active
        out: list[int] = []
        for run in reversed(runs):
            out += run
        return out

    def unhold(self, node: Node | None, now: float) -> Node | None:
        """Drop one reference from ``node`` up to the root. Returns ``node`` if it became an
        evictable leaf (only the deepest node of a path can be a leaf)."""
        deepest = node
        while node is not None and node.parent is not None:
            node.ref -= 1
            node.last_access = now
            if node.ref == 0:
                self.active_blocks -= len(node.blocks)
            node = node.parent
        if (
            deepest is not None
            and deepest.parent is not None
            and deepest.ref == 0
            and not deepest.children
        ):
            return deepest
        return None

    def trim_tail(self, node: Node, k: int) -> list[int]:
        """Remove the last ``k`` blocks of an unreferenced leaf, in O(k); returns their ids.
        What hangs below them on host is the caller's to drop first."""
        assert node.ref == 0 and not node.children and not node.host_children
        assert 0 < k <= len(node.blocks)
        if k == len(node.blocks):
            self.detach(node)
        ids = node.blocks[-k:].tolist()
        del node.blocks[-k:]
        del node.digests[-k * D :]
        del node.tokens[-k * self.block_bytes :]
        self.num_blocks -= k
        self.count_tenant(node, -k)
        return ids

    def remove_subtree(self, top: Node) -> list[tuple[Node, list[int], bytes]]:
        """Take ``top`` and everything below it out of the index (nobody may hold them).

        Returns, per removed node, the node (detached), its block ids and its digests."""
        self.detach(top)
        out = []
        stack = [top]
        while stack:
            node = stack.pop()
            assert node.ref == 0, "removing a held node"
            if node.children:
                stack.extend(node.children.values())
            if node is not top:
                self.num_nodes -= 1
            out.append((node, node.blocks.tolist(), bytes(node.digests)))
            self.num_blocks -= len(node.blocks)
            if node.blocks:
                self.count_tenant(node, -len(node.blocks))
            node.parent = None
        return out

    def detach(self, node: Node) -> None:
        """Unlink ``node`` from its parent (a root left without children, on the GPU or on
        host, is dropped)."""
        parent = node.parent
        assert parent is not None and parent.children is not None and parent.by_token is not None
        del parent.children[bytes(node.digests[:D])]
        token = int.from_bytes(node.tokens[:4], "little")
        group = parent.by_token[token]
        if group is node:
            del parent.by_token[token]
        else:
            assert isinstance(group, TokenGroup)
            group.remove(node, node.tokens[: self.block_bytes])  # bytes compare alike
            last = group.only()
            if last is not None:  # a group of one is kept as the node itself
                parent.by_token[token] = last
        if not parent.children:
            parent.children = parent.by_token = None
            if parent.parent is None:
                self.drop_root_if_bare(parent)
        node.parent = None
        self.num_nodes -= 1

    def drop_root_if_bare(self, node: Node) -> None:
        """``node``, when it is a namespace's root left without children on the GPU or on host,
        leaves the index."""
        if node.parent is None and not node.children and not node.host_children:
            namespace = node.namespace
            if namespace is not None and self.roots.get(namespace) is node:
                del self.roots[namespace]

    def subtree_blocks(self, node: Node) -> int:
        """Blocks cached at or below ``node`` (computed on demand: reports, scheduling)."""
        total, stack = 0, [node]
        while stack:
            cur = stack.pop()
            total += len(cur.blocks)
            if cur.children:
                stack.extend(cur.children.values())
        return total

    def namespace_of(self, node: Node) -> Namespace:
        """The namespace of the tree ``node`` is (or was last) in."""
        assert node.namespace is not None
        return node.namespace

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node of every tree (depth-first)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            if node.children:
                stack.extend(node.children.values())
