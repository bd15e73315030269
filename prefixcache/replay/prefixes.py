"""The prefixes that saved the most tokens: tokens saved per deepest matched prefix.

Every request with a hit counts toward the prefix it matched down to. Only the current leaders
are named by the cache's own digest (of the prefix's last block), computed when a prefix joins
them, so naming costs nothing for the long tail of prefixes seen once.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from prefixcache.hashing import BlockHasher
from prefixcache.namespace import Namespace

_TABLE_LIMIT = 100_000  # distinct prefixes kept; beyond it the half that saved least is dropped


class TopPrefixes:
    def __init__(self, hasher: BlockHasher, k: int = 10) -> None:
        self.hasher, self.k = hasher, k
        self._table: dict[int, list[Any]] = {}  # key -> [name, depth, requests, tokens saved]
        self._top: dict[int, int] = {}  # the k largest savings, always current
        self._floor = 0  # the smallest of them once there are k

    def add(self, key: int, tokens: np.ndarray, ns: Namespace, depth: int, saved: int) -> None:
        entry = self._table.get(key)
        if entry is None:
            entry = self._table[key] = [None, depth, 0, 0]
            if len(self._table) > _TABLE_LIMIT:
                self._prune()
        entry[2] += 1
        total = entry[3] = entry[3] + saved
        top = self._top
        if key in top or len(top) < self.k:
            top[key] = total
        elif total > self._floor:
            del top[min(top, key=top.__getitem__)]
            top[key] = total
        else:
            return
        if entry[0] is None:
            digests = self.hasher.hash_blocks(tokens, self.hasher.seed(ns), 0, depth)
            entry[0] = digests[-1][:8].hex()
        if len(top) == self.k:
            self._floor = min(top.values())

    def _prune(self) -> None:
        keep = dict(heapq.nlargest(_TABLE_LIMIT // 2, self._table.items(), key=lambda kv: kv[1][3]))
        keep.update((k, self._table[k]) for k in self._top)
        self._table = keep

    def top(self) -> list[dict[str, Any]]:
        entries = sorted((self._table[k] for k in self._top), key=lambda e: (-e[3], -e[2]))
        return [
            {"prefix_id": e[0], "depth_blocks": e[1], "requests": e[2], "tokens_saved": e[3]}
            for e in entries
        ]
