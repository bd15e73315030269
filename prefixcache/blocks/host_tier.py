"""The host-memory tier: full blocks evicted from the GPU, kept in host slots, in the radix tree.

Offloaded blocks stay in the tree as *host nodes*: runs of blocks whose ``blocks`` are host slots.
A host node hangs under the node whose last block is its chain parent (a GPU node, another host
node or a namespace root), in that node's ``host_children``, keyed by its first block's digest;
``children`` hold GPU nodes only, so matching and GPU eviction never meet a host node. A block is
on the GPU or on host, never both, and host nodes are never held.

Moving a GPU node's tail to host is a split, or a change of residence when the whole node goes;
loading a run takes host nodes out whole (splitting the last one where the run ends). What hung
below a block of a run taken off host is handed to the caller in a *holder*: the run's node it
hung below, off host now, whose ``host_children`` still hold it, to hang below the GPU node that
ends with the same block.

The tier evicts leaves only (the last block of a host node without host children), least
recently stored first: every block gets a stamp in store order, a node's blocks consecutive ones
(``stamp`` is its first block's). So the blocks on host stay prefix-closed. A slot freed by a load
is not handed out again until ``release_deferred()``: the load that reads it may not have run yet.
"""

from __future__ import annotations

import heapq
from typing import Final, NamedTuple

from prefixcache.blocks.hashing import DIGEST_SIZE, split_digests
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import Node, RadixIndex

D: Final = DIGEST_SIZE
HostBlock = tuple[bytes, Namespace]  # a block that left the host: its digest and namespace


def _left_host(digests: bytes | bytearray, namespace: Namespace | None) -> list[HostBlock]:
    """The blocks of one namespace whose concatenated ``digests`` these are, as they leave the
    host (for the stats and the CPU ``BlockRemoved`` events)."""
    assert namespace is not None
    return [(digest, namespace) for digest in split_digests(bytes(digests))]


class HostEntry(NamedTuple):
    """One block on host, as ``HostTier.entries`` shows it (checks and tests)."""

    slot: int
    parent: bytes  # digest of the chain's previous block (the seed for block 0)
    tokens: bytes  # int32 LE token ids of the block
    position: int  # block index in its sequence
    namespace: Namespace
    stamp: int  # store order: the LRU key


class HostTier:
    """Host slots ``0 .. capacity-1``, the host nodes' bookkeeping and an LRU over leaf blocks.

    The host nodes themselves live in ``index`` (the manager hands over a new one on reset)."""

    def __init__(self, capacity: int, index: RadixIndex) -> None:
        self.capacity = capacity
        self.index = index
        self.num_blocks = 0  # blocks on host
        self._free = list(range(capacity - 1, -1, -1))  # a stack: pops 0, 1, 2, ...
        self.deferred: list[int] = []  # freed by loads of the current step
        # the LRU: a lazy heap of leaf blocks' stamps, and the node each one was the last of
        self._leaves: list[int] = []
        self._leaf_of: dict[int, Node] = {}
        self._stamp = 0  # the last stamp given

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def last_stamp(self) -> int:
        return self._stamp

    def free_slots(self) -> list[int]:
        return list(self._free)

    # ---- views (checks, tests; O(tree)) ----------------------------------------------------
    def nodes(self) -> list[Node]:
        """Every host node, parents before children."""
        out: list[Node] = []
        stack = list(self.index.roots.values())
        while stack:
            node = stack.pop()
            if node.on_host:
                out.append(node)
            if node.children:
                stack.extend(node.children.values())
            if node.host_children:
                stack.extend(node.host_children.values())
        return out

    @property
    def entries(self) -> dict[bytes, HostEntry]:
        """Every block on host by digest, parents before children."""
        out: dict[bytes, HostEntry] = {}
        for node in self.nodes():
            assert node.parent is not None and node.namespace is not None
            bb = len(node.tokens) // len(node.blocks)
            prev = node.parent.last_digest()
            for i, slot in enumerate(node.blocks):
                digest = node.digest(i)
                tokens = bytes(node.tokens[i * bb : (i + 1) * bb])
                out[digest] = HostEntry(
                    slot, prev, tokens, node.depth + i, node.namespace, node.stamp + i
                )
                prev = digest
        return out

    def is_leaf(self, digest: bytes) -> bool:
        """Whether the block ``digest`` is on host with nothing below it there."""
        for node in self.nodes():
            n = len(node.blocks)
            for i in range(n):
                if node.digest(i) == digest:
                    return i == n - 1 and not node.host_children
        return False

    def leaf_records(self) -> set[tuple[int, int]]:
        """The LRU's (stamp, node id) records, stale ones included."""
        leaf_of = self._leaf_of
        return {(stamp, id(leaf_of[stamp])) for stamp in self._leaves if stamp in leaf_of}

    # ---- changes --------------------------------------------------------------------------
    def take_slots(self, k: int, evicted: list[HostBlock]) -> list[int]:
        """Up to ``k`` slots for blocks about to be stored, evicting leaves (least recently
        stored first, appended to ``evicted``) while none is free; fewer when no leaf is left."""
        free = self._free
        slots: list[int] = []
        while len(slots) < k:
            if not free and not self._evict_leaves(k - len(slots), evicted):
                break
            slots.append(free.pop())
        return slots

    def _evict_leaves(self, count: int, evicted: list[HostBlock]) -> int:
        """Evict up to ``count`` blocks from the tail of the leaf whose last block was stored
        least recently (their slots are free at once, the deepest one's on top); returns how
        many, 0 when no block on host is a leaf. Each block is the least recently stored leaf
        in turn: the one before it in its node was stored before it, so before any other."""
        heap, leaf_of = self._leaves, self._leaf_of
        while heap:
            stamp = heapq.heappop(heap)
            node = leaf_of.pop(stamp, None)
            if node is None:
                continue
            n = len(node.blocks)
            if (
                node.parent is None
                or not node.on_host
                or node.host_children
                or n == 0
                or node.stamp + n - 1 != stamp
            ):
                continue  # stale: the node left, grew host children or lost this block
            c = count if count < n else n
            bb = len(node.tokens) // n
            digests = node.digests
            gone = _left_host(digests[(n - c) * D :], node.namespace)
            gone.reverse()  # the deepest first
            evicted += gone
            if c == n:
                self._unlink(node)  # (keyed by its first block: before the trim)
            self._free.extend(node.blocks[n - c :])
            del node.blocks[n - c :], digests[(n - c) * D :], node.tokens[(n - c) * bb :]
            self.num_blocks -= c
            if c < n:
                self._push(node, stamp - c)
            return c
        return 0

    def store_tail(self, node: Node, k: int, slots: list[int]) -> list[HostBlock]:
        """Move the last ``k`` blocks of the unheld GPU leaf ``node`` to host: the first
        ``len(slots)`` of them into ``slots``, as one host node; the rest leave the cache with
        everything below them on host (returned, their slots free at once). The index loses all
        ``k`` GPU blocks: read their ids first."""
        index = self.index
        n, s, bb = len(node.blocks), len(slots), index.block_bytes
        first = n - k
        dropped: list[HostBlock] = []
        if s < k and node.host_children:  # below a block that is not kept
            dropped = self.drop_below(node)
        if s == 0:
            index.trim_tail(node, k)
            return dropped
        if first == 0:  # the whole node goes: it changes residence
            if s < k:
                del node.digests[s * D :], node.tokens[s * bb :]
            parent = node.parent
            assert parent is not None
            key = bytes(node.digests[:D])
            if parent.host_children is None:
                parent.host_children = {key: node}
            else:
                parent.host_children[key] = node
            index.detach(node)  # a root keeps its host child
            index.num_blocks -= k
            index.count_tenant(node, -k)
            node.parent = parent
            blocks = node.blocks  # reused for the slots
            if s < k:
                del blocks[s:]
            for x in range(s):
                blocks[x] = slots[x]
            node.on_host = True
            node.heap_token += 1  # what the GPU's eviction heap holds for it is stale
            host = node
        else:  # the tail goes: a host node below the rest
            blocks = node.blocks[first : first + s]  # an array of the right size for the slots
            for x in range(s):
                blocks[x] = slots[x]
            host = Node(
                node,
                node.depth + first,
                node.digests[first * D : (first + s) * D],
                node.tokens[first * bb : (first + s) * bb],
                blocks,
            )
            host.namespace = node.namespace
            host.on_host = True
            self.hang(node, host)  # what continued the node's last block continues the host's
            del node.blocks[first:], node.digests[first * D :], node.tokens[first * bb :]
            index.num_blocks -= k
            index.count_tenant(node, -k)
            node.host_children = {bytes(host.digests[:D]): host}
        host.stamp = self._stamp + 1
        self._stamp += s
        self.num_blocks += s
        if not host.host_children:
            self._push(host, self._stamp)
        return dropped

    def take_run(
        self, parent: Node, digests: list[bytes]
    ) -> tuple[list[int], list[tuple[int, Node]]]:
        """Take the host blocks ``digests`` (a chain that continues ``parent``'s last block)
        off host to load them. Returns their slots, free at ``release_deferred()``, and the
        holders of what hung below them: (blocks of the run up to the holder, holder)."""
        chain, holders, _ = self._take_chain(parent, digests, 0, known=True)
        slots: list[int] = []
        for node in chain:
            slots.extend(node.blocks)
        self.deferred.extend(slots)
        self.num_blocks -= len(slots)
        return slots, holders

    def take_recomputed(
        self, parent: Node, digests: list[bytes], start: int
    ) -> tuple[int, list[HostBlock], list[tuple[int, Node]]]:
        """The GPU computed again the blocks ``digests[start:]`` after ``parent``, whose host
        children hold the first of them: the leading ones on host leave it (their slots free
        at once). Returns the index in ``digests`` after the last of them, the blocks, and the
        holders of what hung below them: (index in ``digests`` after the holder, holder)."""
        chain, holders, end = self._take_chain(parent, digests, start)
        gone: list[HostBlock] = []
        for node in chain:
            gone += _left_host(node.digests, node.namespace)
            self._free.extend(node.blocks)
        self.num_blocks -= end - start
        return end, gone, holders

    @staticmethod
    def hang(holder: Node, node: Node) -> None:
        """What hung below ``holder`` on host hangs below ``node``, whose last block is the
        holder's (``node`` has no host children)."""
        below = holder.host_children
        if below:
            holder.host_children = None
            node.host_children = below
            for child in below.values():
                child.parent = node

    def drop_below(self, node: Node) -> list[HostBlock]:
        """Everything on host below ``node``, whose last block leaves the cache (a node, never a
        root), leaves it too, parents before children; slots free at once."""
        below = node.host_children
        if not below:
            return []
        node.host_children = None
        out: list[HostBlock] = []
        stack = list(below.values())
        while stack:
            cur = stack.pop()
            if cur.host_children:
                stack.extend(cur.host_children.values())
            out += _left_host(cur.digests, cur.namespace)
            self._free.extend(cur.blocks)
            self.num_blocks -= len(cur.blocks)
            cur.parent = None
        return out

    def release_deferred(self) -> None:
        """Slots freed by loads become free: the loads that read them have run."""
        if self.deferred:
            self._free.extend(self.deferred)
            self.deferred.clear()

    def clear(self) -> None:
        """Every slot free again, no block on host (the manager drops the index's nodes)."""
        self.num_blocks = 0
        self._free = list(range(self.capacity - 1, -1, -1))
        self.deferred.clear()
        self._leaves.clear()
        self._leaf_of.clear()

    # ---- internals ------------------------------------------------------------------------
    def _push(self, node: Node, stamp: int) -> None:
        """``node`` is a leaf whose last block has ``stamp``."""
        self._leaf_of[stamp] = node
        heapq.heappush(self._leaves, stamp)
        if len(self._leaves) > 2 * self.num_blocks + 64:
            self._compact()

    def _take_chain(
        self, parent: Node, digests: list[bytes], start: int, *, known: bool = False
    ) -> tuple[list[Node], list[tuple[int, Node]], int]:
        """Take off host the longest chain of blocks ``digests[start:]`` below ``parent``
        (whose host children hold the first), splitting the last node where the chain ends.
        Returns its nodes (off host now, their slots still theirs), the holders of what hung
        below them (index in ``digests`` after the holder, holder) and the index after the
        chain. The holders are the chain's nodes: what hangs below them stays there.
        ``known``: the caller found the chain on host already, so digests are not compared."""
        assert parent.host_children is not None
        node = parent.host_children[digests[start]]
        chain: list[Node] = []
        holders: list[tuple[int, Node]] = []
        i, total = start, len(digests)
        while True:
            n, j = len(node.blocks), 0
            if known:  # the chain is on host as far as ``digests`` go
                j = n if n < total - i else total - i
            while j < n and i + j < total and node.digests[j * D : (j + 1) * D] == digests[i + j]:
                j += 1
            if j < n:  # the chain ends inside this node: its rest stays on host
                node = self._split(node, j)
            chain.append(node)
            i += j
            kids = node.host_children
            if j < n or i == total or kids is None or digests[i] not in kids:
                break
            node = kids[digests[i]]
        end = start
        for x, node in enumerate(chain):  # each node's other host children stay with it
            end += len(node.blocks)
            if x + 1 < len(chain):
                kids = node.host_children
                assert kids is not None
                del kids[bytes(chain[x + 1].digests[:D])]
                if not kids:
                    node.host_children = None
            if node.host_children:
                holders.append((end, node))
        self._unlink(chain[0], keep_root=True)  # the chain's GPU blocks go below it
        for node in chain:
            node.on_host = False
            node.parent = None
        return chain, holders, i

    def _split(self, node: Node, j: int) -> Node:
        """Split a host node after ``j`` blocks; returns the upper part, which takes its place.
        ``node`` keeps the rest, its stamps and its place in the LRU."""
        parent = node.parent
        assert parent is not None and parent.host_children is not None and 0 < j < len(node.blocks)
        bb = len(node.tokens) // len(node.blocks)
        upper = Node(parent, node.depth, node.digests[: j * D], node.tokens[: j * bb])
        upper.blocks = node.blocks[:j]
        upper.namespace, upper.on_host, upper.stamp = node.namespace, True, node.stamp
        parent.host_children[bytes(upper.digests[:D])] = upper
        del node.digests[: j * D], node.tokens[: j * bb], node.blocks[:j]
        node.depth += j
        node.stamp += j
        node.parent = upper
        upper.host_children = {bytes(node.digests[:D]): node}
        return upper

    def _unlink(self, node: Node, *, keep_root: bool = False) -> None:
        """Take a host node out of its parent's host children (its own stay with it).
        ``keep_root``: a root left bare stays (GPU blocks are about to go below it)."""
        parent = node.parent
        assert parent is not None and parent.host_children is not None
        kids = parent.host_children
        del kids[bytes(node.digests[:D])]
        node.parent = None
        if not kids:
            parent.host_children = None
            if parent.on_host:  # the parent's last block is a leaf now
                self._push(parent, parent.stamp + len(parent.blocks) - 1)
            elif not keep_root:
                self.index.drop_root_if_bare(parent)

    def _compact(self) -> None:
        """Drop stale heap records once they outnumber the blocks on host."""
        kept: dict[int, Node] = {}
        for stamp, node in self._leaf_of.items():
            n = len(node.blocks)
            if (
                node.parent is not None
                and node.on_host
                and not node.host_children
                and n
                and node.stamp + n - 1 == stamp
            ):
                kept[stamp] = node
        self._leaf_of = kept
        self._leaves = list(kept)
        heapq.heapify(self._leaves)
