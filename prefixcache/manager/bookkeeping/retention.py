"""Retention claims on cached blocks: the priority a request gives its blocks under the
``priority`` eviction policy, and how long that priority holds."""

from __future__ import annotations

from prefixcache.blocks.radix import Node

Claim = tuple[int, float]  # (priority, retained until): lower priority is evicted first


def add_claim(node: Node | None, claim: Claim, now: float) -> None:
    """Add a request's retention claim to its path, from ``node`` up to the root.

    A node keeps the claims that can still decide: the highest live priority wins, and a lower
    one that outlives it takes over when its retention ends. A node that keeps the claim already
    has it on its whole path (it was added to the path, or dropped where a claim that outlasts
    it wins): the walk stops there, so a decoding request adds it to its new blocks only."""
    while node is not None and node.parent is not None:
        if (node.priority, node.retain_until) == claim or claim in node.later:
            return
        claims = [(node.priority, node.retain_until), *node.later, claim]
        claims.sort(key=_strongest_first)
        kept: list[Claim] = []
        outlasted = now  # a claim counts while no higher one outlasts it
        for priority, until in claims:
            if until > outlasted:
                kept.append((priority, until))
                outlasted = until
        node.priority, node.retain_until = kept[0] if kept else (0, 0.0)
        node.later = tuple(kept[1:])
        node = node.parent


def _strongest_first(claim: Claim) -> tuple[int, float]:
    priority, until = claim
    return -priority, -until
