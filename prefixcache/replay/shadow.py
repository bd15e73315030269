"""The infinite cache next to the real one: which full-block prefixes a replay has seen so far.

An infinite cache with the same block size would hit every full block whose prefix it has seen in
the same namespace. Keeping the set of prefix keys per namespace (and, when several namespaces
occur, a namespace-free set) answers that in O(blocks) per request, and tells apart blocks the
real cache lost to eviction (seen here) from blocks it could never have had (cold) and blocks
cached only under another namespace (isolation).
"""

from __future__ import annotations

from xxhash import xxh3_64

from prefixcache.namespace import Namespace
from prefixcache.replay.fingerprint import NEUTRAL_SEED, NamespaceSeeds


class Shadow:
    def __init__(self, block_size: int, track_isolation: bool) -> None:
        self.block_bytes = 4 * block_size
        self.track_isolation = track_isolation
        self.seen: set[int] = set()  # prefix keys seen, namespace in the key
        self.seen_neutral: set[int] = set()  # the same prefixes without the namespace
        self.seed = NamespaceSeeds()

    @property
    def unique_blocks(self) -> int:
        """Blocks an infinite cache would hold now."""
        return len(self.seen)

    def observe(
        self, buf: bytes, num_blocks: int, namespace: Namespace, known: int = 0
    ) -> tuple[int | None, int, int]:
        """Look up, then remember, the full-block prefixes of a sequence whose first ``known``
        blocks are known to be seen (the cache just matched them).

        Returns ``(key, u, v)``: the key of block ``known - 1`` (None when ``known`` is 0), the
        leading blocks seen before in this namespace (``u``) and in any namespace (``v >= u``;
        ``v == u`` when isolation is not tracked).
        """
        bb = self.block_bytes
        state = xxh3_64(buf[: known * bb], self.seed(namespace))
        anchor = state.intdigest() if known else None
        u = _extend(state, buf, bb, known, num_blocks, self.seen)
        v = u
        if self.track_isolation and u < num_blocks:
            neutral = xxh3_64(buf[: u * bb], NEUTRAL_SEED)
            v = _extend(neutral, buf, bb, u, num_blocks, self.seen_neutral)
        return anchor, u, v


def _extend(state: xxh3_64, buf: bytes, bb: int, start: int, end: int, seen: set[int]) -> int:
    """Walk blocks ``start .. end-1`` with a hash state holding the blocks before ``start``:
    count the leading keys in ``seen``, add the others (a chain past an unseen block is unseen)."""
    update, digest = state.update, state.intdigest
    k = start
    offset = start * bb
    while k < end:
        update(buf[offset : offset + bb])
        offset += bb
        key = digest()
        if key not in seen:
            seen.add(key)
            add = seen.add
            for o in range(offset, end * bb, bb):
                update(buf[o : o + bb])
                add(digest())
            return k
        k += 1
    return end
