"""Eviction order: a policy is one key function over a cached leaf; the smallest key goes first.

A key is any orderable value: a float for ``lru`` (so the heap compares floats, not tuples), a
tuple where a policy orders by several things.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from prefixcache.blocks.radix import Node
from prefixcache.errors import ConfigError

PolicyKey = Callable[[Node, float], Any]


def live_claim(node: Node, now: float) -> tuple[int, float]:
    """The retention claim on ``node`` that decides now: the highest priority whose retention
    still runs, and when it ends; ``(0, inf)`` when no claim runs."""
    if now < node.retain_until:
        return node.priority, node.retain_until
    for priority, until in node.later:
        if now < until:
            return priority, until
    return 0, math.inf


POLICIES: dict[str, PolicyKey] = {
    # least recently used first
    "lru": lambda n, now: n.last_access,
    # least often hit first, then least recently used
    "lfu": lambda n, now: (n.hits, n.last_access),
    # lowest live priority first (a retention that ended counts no more), then LRU
    "priority": lambda n, now: (live_claim(n, now)[0], n.last_access),
}


def get_policy(policy: str | PolicyKey) -> PolicyKey:
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ConfigError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[policy]


class Evictor:
    """A lazy heap of evictable GPU leaves (ref 0, no GPU children).

    A node is pushed whenever it becomes evictable; entries made stale by a later push, a new
    reference or a new child are skipped when popped. A priority whose retention ends changes the
    key without any event, so such nodes also sit in an expiry heap and are re-keyed on time.
    """

    def __init__(self, policy: str | PolicyKey) -> None:
        self.key = get_policy(policy)
        self._heap: list[tuple[Any, int, int, Node]] = []
        self._expiring: list[tuple[float, int, int, Node]] = []
        self._counter = 0

    def push(self, node: Node, now: float) -> Any:
        """File an evictable leaf under its key now (an earlier entry for it goes stale);
        returns the key."""
        node.heap_token += 1
        self._counter += 1
        key = self.key(node, now)
        heapq.heappush(self._heap, (key, self._counter, node.heap_token, node))
        if node.retain_until > now or node.later:  # only nodes with claims (not lru's)
            expiry = live_claim(node, now)[1]
            if expiry < math.inf:
                heapq.heappush(self._expiring, (expiry, self._counter, node.heap_token, node))
        return key

    def peek(self, now: float) -> tuple[Any, Node] | None:
        """The key and the leaf ``pop`` would return now, left in the heap (stale entries on
        top are dropped); None when nothing is evictable."""
        key = Evictor.own_top_key(self, now)
        return (key, self._heap[0][3]) if key is not None else None

    def own_top_key(self, now: float) -> Any:
        """The smallest live key of this heap's own entries (None when there is none), left on
        top (a subclass with more heaps keeps this to its own)."""
        if self._expiring and self._expiring[0][0] <= now:
            self._requeue_expired(now)
        heap = self._heap
        while heap:
            entry = heap[0]
            node = entry[3]
            if entry[2] == node.heap_token and self.evictable(node):
                return entry[0]
            heapq.heappop(heap)
        return None

    def _requeue_expired(self, now: float) -> None:
        """File again, under their key now, the leaves whose retention has ended."""
        while self._expiring and self._expiring[0][0] <= now:
            _, _, token, node = heapq.heappop(self._expiring)
            if token == node.heap_token and self.evictable(node):
                self.push(node, now)

    def pop_own_top(self) -> Node:
        """Remove and return this heap's own top leaf (right after ``own_top_key`` found it)."""
        return heapq.heappop(self._heap)[3]

    def filed_ids(self) -> set[int]:
        """The ids of the nodes the heap holds a current entry for (an integrity check)."""
        return {id(e[3]) for e in self._heap if e[2] == e[3].heap_token}

    def __len__(self) -> int:
        """Entries in the heap, stale ones included (an upper bound on the evictable leaves)."""
        return len(self._heap)

    def pop(self, now: float) -> Node | None:
        """Remove and return the evictable leaf with the smallest key (None if there is none)."""
        if self._expiring and self._expiring[0][0] <= now:
            self._requeue_expired(now)
        heap, pop = self._heap, heapq.heappop
        while heap:
            _, _, token, node = pop(heap)
            if (  # ``evictable``, inline
                token == node.heap_token
                and node.ref == 0
                and not node.children
                and node.parent is not None
                and node.blocks
                and not node.on_host
            ):
                return node
        return None

    def compact(self, live_nodes: int) -> None:
        """Drop stale entries once they outnumber the live nodes, so the heap stays bounded."""
        if len(self._heap) > 2 * live_nodes + 1024:
            self._heap = [e for e in self._heap if e[2] == e[3].heap_token and self.evictable(e[3])]
            heapq.heapify(self._heap)
            self._expiring = [e for e in self._expiring if e[2] == e[3].heap_token]
            heapq.heapify(self._expiring)

    def clear(self) -> None:
        """Forget every entry (the index they point into was emptied)."""
        self._heap.clear()
        self._expiring.clear()

    @staticmethod
    def evictable(node: Node) -> bool:
        """Whether ``node`` is a leaf eviction may take: cached on the GPU, nobody holds it,
        nothing below it."""
        return (
            node.ref == 0
            and not node.children
            and node.parent is not None
            and len(node.blocks) > 0
            and not node.on_host
        )
