"""64-bit fingerprints of every full-block prefix, for the replay's shadow bookkeeping.

``key_k = xxh3_64(tokens of blocks 0..k, seed)`` with the seed from the namespace, or a fixed
neutral seed for the namespace-free keys. A streaming hash state (in ``shadow``) yields the keys
block after block, and starting it at block ``k`` costs one bulk update, so a prefix the cache
already matched is never hashed block by block. A 64-bit collision (about 2**-64 per pair) could
only shift the upper bound or a miss cause by one block; the cache itself never sees these keys.
"""

from __future__ import annotations

import xxhash

from prefixcache.namespace import Namespace

NEUTRAL_SEED = 0x5EED
_h64 = xxhash.xxh3_64_intdigest


class NamespaceSeeds:
    """The key seed of each namespace, cached."""

    def __init__(self) -> None:
        self._seeds: dict[Namespace, int] = {}

    def __call__(self, namespace: Namespace) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = _h64(b"prefixcache/replay/ns\x00" + namespace.canonical_bytes())
            self._seeds[namespace] = seed
        return seed
