"""Token ids for Mooncake traces, which give only a hash id per 512-token block.

Each hash id's block is synthesized once (counter-based, so it depends only on the id and the
seed) and kept in a bounded cache; a request's tokens are the concatenation of its blocks, the
last one cut to the input length (a partial block is the head of its id's block).
"""

from __future__ import annotations

import numpy as np

from prefixcache.replay.synth import FULL_VOCAB, blocks_tokens, mix64, stream_key


class MooncakeTokens:
    def __init__(
        self,
        block_size: int = 512,
        seed: int = 0,
        vocab_size: int | None = None,
        max_cached_blocks: int = 1 << 16,
    ) -> None:
        self.block_size = block_size
        self.vocab = vocab_size or FULL_VOCAB
        self._salt = np.uint64(stream_key("mooncake", seed))
        self._cache: dict[int, np.ndarray] = {}
        self._limit = max_cached_blocks

    def tokens(self, hash_ids: list[int], length: int) -> np.ndarray:
        """int32 tokens of a request with these hash ids and ``length`` input tokens."""
        cache = self._cache
        missing = [h for h in hash_ids if h not in cache]
        if missing:
            if not all(type(h) is int and h >= 0 for h in missing):
                raise ValueError("hash ids must be integers >= 0")
            if len(cache) + len(missing) > self._limit:
                cache.clear()  # a crude bound: blocks are regenerated identically when needed
                missing = list(dict.fromkeys(hash_ids))
            ids = np.asarray(missing, dtype=np.uint64)
            rows = blocks_tokens(mix64(ids ^ self._salt), self.block_size, self.vocab)
            for h, row in zip(missing, rows, strict=True):
                cache[h] = row
        if len(hash_ids) == 1:
            return cache[hash_ids[0]][:length]
        return np.concatenate([cache[h] for h in hash_ids])[:length]
