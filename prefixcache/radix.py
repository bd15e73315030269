"""Radix index over full blocks: one tree per namespace, path-compressed, split on divergence.

A node holds a run of consecutive full blocks (their digests, token ids and physical ids). Children
are keyed by the digest of their first block, so a lookup costs one hash and one dict probe per
node; a digest match is then confirmed by comparing token ids, so a collision never serves a
wrong block. A request holds every node from the root down to its deepest one (``ref`` counts the
holders), which keeps the held set, like the cached set, prefix-closed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from prefixcache.hashing import DIGEST_SIZE, BlockHasher
from prefixcache.namespace import Namespace

D = DIGEST_SIZE
MAX_GROW_BLOCKS = 256  # a node grows in place up to this many blocks, then a child takes over


def common_tokens(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Number of leading int32 tokens two equally long LE token buffers share."""
    if a == b:
        return len(a) // 4
    x = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    return ((x & -x).bit_length() - 1) // 32  # lowest differing bit -> its token


class Node:
    """A run of full blocks. The root of a namespace has no blocks; its ``digests`` is the seed."""

    __slots__ = (
        "blocks",
        "by_token",
        "children",
        "depth",
        "digests",
        "heap_token",
        "hits",
        "last_access",
        "namespace",
        "parent",
        "priority",
        "ref",
        "retain_until",
        "tokens",
    )

    def __init__(self, parent: Node | None, depth: int) -> None:
        self.parent = parent
        self.depth = depth  # blocks before this node's first block
        self.children: dict[bytes, Node] | None = None
        self.by_token: dict[int, Node] | None = None  # first token id -> a child (partial copies)
        self.digests = b""  # 16 bytes per block
        self.tokens = b""  # block_size int32 LE per block
        self.blocks = array("i")  # physical block ids
        self.ref = 0
        self.last_access = 0.0
        self.hits = 0
        self.priority = 0
        self.retain_until = 0.0
        self.heap_token = 0
        self.namespace: Namespace | None = None  # set on roots only

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, blocks={list(self.blocks)}, ref={self.ref})"

    @property
    def end(self) -> int:
        """Index of the block after this node's last one."""
        return self.depth + len(self.blocks)

    def last_digest(self) -> bytes:
        return bytes(self.digests[-D:])


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

    # ---- lookup ---------------------------------------------------------------------------
    def root(self, namespace: Namespace) -> Node:
        node = self.roots.get(namespace)
        if node is None:
            node = Node(None, 0)
            node.digests = self.hasher.seed(namespace)
            node.namespace = namespace
            self.roots[namespace] = node
        return node

    def match(self, root: Node, buf: bytes, num_full: int) -> tuple[Node, int, int, bytes]:
        """Longest cached prefix of the first ``num_full`` blocks. Read-only.

        Returns ``(node, j, n, digest)``: ``n`` blocks match, the last ``j`` of them inside
        ``node`` (``j < len(node)`` when the match stops mid-node); ``digest`` is h_{n-1}.
        """
        bb = self.block_bytes
        hash_block = self.hasher.hash_block
        node, j, n = root, 0, 0
        digest = bytes(root.digests)
        while n < num_full:
            children = node.children
            if not children:
                break
            child = children.get(hash_block(digest, n, buf[n * bb : (n + 1) * bb]))
            if child is None:
                break
            k = min(len(child.blocks), num_full - n)
            if child.tokens[: k * bb] == buf[n * bb : (n + k) * bb]:
                m = k
            else:
                m = self._common_blocks(child, 0, buf, n, k)
            if m == 0:  # digest collision on the first block: not a hit
                break
            node, j, n = child, m, n + m
            digest = bytes(child.digests[(m - 1) * D : m * D])
            if m < len(child.blocks):
                break
        return node, j, n, digest

    def _common_blocks(
        self, node: Node, off: int, buf: bytes | bytearray, start: int, k: int
    ) -> int:
        """How many of ``k`` blocks from ``node[off]`` equal the sequence's from ``start``."""
        bb = self.block_bytes
        return (
            common_tokens(
                node.tokens[off * bb : (off + k) * bb], buf[start * bb : (start + k) * bb]
            )
            // self.block_size
        )

    def path_blocks(self, node: Node) -> list[int]:
        """Physical ids of every block from the root down to the end of ``node``."""
        runs = []
        while node.parent is not None:
            runs.append(node.blocks)
            node = node.parent
        out: list[int] = []
        for run in reversed(runs):
            out.extend(run)
        return out

    def partial_candidate(
        self, node: Node, buf: bytes, n: int, limit: int
    ) -> tuple[Node, int] | None:
        """A child of ``node`` (whose blocks a sequence matched in full, ``n`` blocks in all)
        whose first block shares the first ``m`` tokens (0 < m <= limit) of the sequence's
        block ``n``. Returns ``(child, m)`` or None; the most recent child with the same first
        token is the one tried."""
        if not node.by_token:
            return None
        start = n * self.block_bytes
        cand = node.by_token.get(int.from_bytes(buf[start : start + 4], "little"))
        if cand is None:
            return None
        m = common_tokens(cand.tokens[: 4 * limit], buf[start : start + 4 * limit])
        return (cand, m) if m > 0 else None

    # ---- structure ------------------------------------------------------------------------
    def split(self, node: Node, j: int) -> Node:
        """Split ``node`` after ``j`` blocks; returns the new upper node. ``node`` keeps the rest
        (and its identity, so holders that point at it stay valid)."""
        parent = node.parent
        assert parent is not None and 0 < j < len(node.blocks)
        bb = self.block_bytes
        upper = Node(parent, node.depth)
        upper.digests = node.digests[: j * D]
        upper.tokens = node.tokens[: j * bb]
        upper.blocks = node.blocks[:j]
        node.digests = node.digests[j * D :]
        node.tokens = node.tokens[j * bb :]
        del node.blocks[:j]
        upper.ref, upper.last_access, upper.hits = node.ref, node.last_access, node.hits
        upper.priority, upper.retain_until = node.priority, node.retain_until
        first = bytes(upper.digests[:D])
        assert parent.children is not None
        parent.children[first] = upper
        first_tok = int.from_bytes(upper.tokens[:4], "little")
        if parent.by_token is not None and parent.by_token.get(first_tok) is node:
            parent.by_token[first_tok] = upper
        upper.children = {bytes(node.digests[:D]): node}
        upper.by_token = {int.from_bytes(node.tokens[:4], "little"): node}
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
        growing sequence keeps few nodes; otherwise (or once the run is long, since growing an
        immutable buffer copies it) adds a child.
        """
        if (
            parent.parent is not None
            and parent.ref == 1
            and not parent.children
            and len(parent.blocks) < MAX_GROW_BLOCKS
        ):
            node = parent
        else:
            node = Node(parent, parent.end if parent.parent is not None else 0)
            node.ref = 1
            if parent.children is None:
                parent.children, parent.by_token = {}, {}
            parent.children[digests[0]] = node
            assert parent.by_token is not None
            parent.by_token[int.from_bytes(tokens[:4], "little")] = node
            self.num_nodes += 1
        # immutable, exactly sized buffers: growth copies, but nothing is over-allocated
        node.digests += b"".join(digests)
        node.tokens += tokens
        node.blocks.extend(blocks)
        node.last_access = now
        self.num_blocks += len(blocks)
        self.active_blocks += len(blocks)
        return node

    def hold(self, node: Node, now: float, hit: bool = False) -> None:
        """Take one reference on every node from ``node`` up to the root (``hit``: count a hit)."""
        while node.parent is not None:
            if node.ref == 0:
                self.active_blocks += len(node.blocks)
            node.ref += 1
            node.last_access = now
            node.hits += hit
            node = node.parent

    def hold_one(self, node: Node, now: float) -> None:
        """Take one reference on ``node`` alone (its parent is already held by the caller)."""
        if node.ref == 0:
            self.active_blocks += len(node.blocks)
        node.ref += 1
        node.last_access = now

    def unhold(self, node: Node, now: float) -> Node | None:
        """Drop one reference from ``node`` up to the root. Returns ``node`` if it became an
        evictable leaf (only the deepest node of a path can be a leaf)."""
        deepest = node
        while node.parent is not None:
            node.ref -= 1
            node.last_access = now
            if node.ref == 0:
                self.active_blocks -= len(node.blocks)
            node = node.parent
        if deepest.parent is not None and deepest.ref == 0 and not deepest.children:
            return deepest
        return None

    def evict_tail(self, node: Node, k: int) -> tuple[list[int], bytes]:
        """Remove the last ``k`` blocks of an unreferenced leaf. Returns their ids and their
        concatenated digests."""
        assert node.ref == 0 and not node.children and 0 < k <= len(node.blocks)
        ids = node.blocks[-k:].tolist()
        digests = bytes(node.digests[-k * D :])
        first_token = int.from_bytes(node.tokens[:4], "little")
        del node.blocks[-k:]
        node.digests = node.digests[: -k * D]
        node.tokens = node.tokens[: -k * self.block_bytes]
        self.num_blocks -= k
        if not node.blocks:
            self._detach(node, digests[:D], first_token)
        return ids, digests

    def _detach(self, node: Node, first_digest: bytes, first_token: int) -> None:
        parent = node.parent
        assert parent is not None and parent.children is not None and parent.by_token is not None
        del parent.children[first_digest]
        if parent.by_token.get(first_token) is node:
            del parent.by_token[first_token]
        if not parent.children:
            parent.children = parent.by_token = None
        node.parent = None
        self.num_nodes -= 1

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
        while node.parent is not None:
            node = node.parent
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
