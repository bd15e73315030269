"""A conventional per-block prefix cache, as a same-run baseline for bench/manager_loop.py.

It follows the common design (vLLM v1's block pool, nano-vllm's block manager): every full block
is hashed (sha256 over parent digest + a pickle of the token tuple), looked up in a dict of
digest -> block, reference counted per block, and freed blocks wait in an LRU queue from which
the oldest cached block is evicted. Correct for the workload, not tuned beyond the common design.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict

import numpy as np


class Block:
    __slots__ = ("block_id", "digest", "ref", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.digest: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BaselineBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, Block] = {}
        self.tables: dict[int, list[Block]] = {}
        self.hit_tokens = self.prompt_tokens = 0

    def _take(self) -> Block:
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.digest is not None:  # evict its cached content
            del self.cached[block.digest]
            block.digest = None
        return block

    def admit(self, rid: int, tokens: np.ndarray) -> int:
        ids = tokens.tolist()
        p, parent = self.block_size, b""
        table: list[Block] = []
        hit = 0
        missing = False
        for start in range(0, len(ids), p):
            chunk = tuple(ids[start : start + p])
            digest = None
            if len(chunk) == p:
                digest = hashlib.sha256(parent + pickle.dumps(chunk)).digest()
                parent = digest
            block = None if missing or digest is None else self.cached.get(digest)
            if block is not None and block.token_ids == chunk:
                if block.ref == 0:
                    del self.free[block.block_id]
                block.ref += 1
                hit += p
            else:
                missing = True
                block = self._take()
                block.ref = 1
                if digest is not None:
                    block.digest, block.token_ids = digest, chunk
                    self.cached[digest] = block
            table.append(block)
        self.tables[rid] = table
        hit = min(hit, len(ids) - 1)
        self.hit_tokens += hit
        self.prompt_tokens += len(ids)
        return hit

    def release(self, rid: int) -> None:
        for block in reversed(self.tables.pop(rid)):  # tail first: evicted before its prefix
            block.ref -= 1
            if block.ref == 0:
                self.free[block.block_id] = None
