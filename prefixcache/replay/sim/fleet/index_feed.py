"""A replica's cache events straight into the fleet index of a fleet replay.

The service learns what a replica holds from its KV events: each batch is encoded on the wire,
decoded by the subscriber, and applied by ``fleet.events.index_writer.EventApplier``, which hashes
every stored run again under the namespace the event names. A fleet replay's replicas are
prefixcache managers in the same process, so the index can take their events as they happen,
with the same outcome and none of the wire or the rehashing: ``ReplicaIndexFeed`` is a manager
listener that applies each event to the index as the applier would for such a replica
(``tests/replay/test_replay_event_loop.py`` compares every fleet figure with the wire path's).

What the applier would make of an event, for a replica whose events carry prefixcache digests:

- A stored run lands under the digests its blocks have, on the index's medium for the event's
  (``GPU``, or ``CPU`` for anything off the GPU); a block keeps a mask of the media holding it.
- Except where the namespace the applier rebuilds from the event differs from the run's own:
  KV events carry no adapter version, so a run under an adapter whose version is not the one the
  fleet pins (the first a request named) is filed under the pinned version: its chain is hashed
  again from the chain's start (and every run continuing it after), as the service would see it.
- A removal takes the medium's bit off each block it names; the index drops the block from that
  medium unless another medium off the GPU still holds it, and drops it entirely with no bit
  left. A reset clears the replica.
- A run stored without tokens marks the media of the blocks already known.

The feed reads token ids only to hash a chain again, so it listens without them
(``add_listener(..., token_ids=False)``: the manager builds no token list for its events) until
a request names an adapter version other than the pinned one (``FleetSimulator``); then every
stored run carries its tokens, and a run without them is one of the above.

The applier's caps (blocks per replica) and the checks a remote engine's events need (malformed
runs, unknown parents, duplicate hashes) have nothing to catch here: the manager's events are
well formed, and a run's parent is always held when it is stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import as_token_array
from prefixcache.fleet.events.index_writer import canonical_medium, index_medium
from prefixcache.fleet.index.mask_loops import remove_masks, store_masks
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.manager.block_events import BlockRemoved, BlockStored, CacheEvent
from prefixcache.medium import CPU, GPU

_GPU_BIT = 1
_MAX_MEDIA = 24  # as the applier: media told apart per replica, further names share the last


class _Medium(NamedTuple):
    """How the feed files one of the manager's media."""

    bit: int  # in the feed's mask of the media holding a block
    index_medium: str  # the index's medium: GPU, or CPU for anything off the GPU
    off_gpu: bool


_ON_GPU = _Medium(_GPU_BIT, GPU, False)


class ReplicaIndexFeed:
    """Applies one replica's manager events to ``index`` as the KV-event path would; call it
    with each event (a manager listener). ``versions`` is the fleet's pinned adapter versions,
    ``(model, adapter) -> version``, read at each chain's start."""

    def __init__(
        self,
        index: MemoryFleetIndex,
        replica: str,
        hasher: BlockHasher,
        versions: dict[tuple[str, str], str],
        *,
        held: Iterable[bytes] = (),
        token_ids: bool = True,
    ) -> None:
        """``held``: the blocks the replica holds on its GPU as the feed starts, each filed in
        ``index`` under its own digest already. ``token_ids``: its events carry token ids (it
        was added as a listener that reads them)."""
        self.index, self.replica, self.hasher, self.versions = index, replica, hasher, versions
        self.token_ids = token_ids
        # block digest -> mask of the media holding it
        self.media: dict[bytes, int] = dict.fromkeys(held, _GPU_BIT)
        # blocks filed under another digest than their own (another adapter version): own
        # digest -> (the index's digest, position in the sequence)
        self.renamed: dict[bytes, tuple[bytes, int]] = {}
        self._bits: dict[str, int] = {GPU: _GPU_BIT, CPU: 2}
        self._media_of: dict[str | None, _Medium] = {None: _ON_GPU, GPU: _ON_GPU}  # by name
        # the index's writes go without the checks of arguments the manager's events satisfy,
        # into a MemoryFleetIndex's masks with no Python frame between (``mask_loops``)
        self._direct = type(index) is MemoryFleetIndex

    def __call__(self, event: CacheEvent) -> None:
        kind = type(event)
        if kind is BlockStored:
            self._stored(event)  # type: ignore[arg-type]
        elif kind is BlockRemoved:
            self._removed(event)  # type: ignore[arg-type]
        else:  # AllBlocksCleared
            self.media.clear()
            self.renamed.clear()
            self.index.clear(self.replica)

    def _store(self, digests: list[bytes], medium: str) -> None:
        if self._direct:
            store_masks(self.index, self.replica, digests, medium)
        else:
            self.index.store_unchecked(self.replica, digests, medium)

    def _remove(self, digests: list[bytes], medium: str) -> None:
        if self._direct:
            remove_masks(self.index, self.replica, digests, medium)
        else:
            self.index.remove_unchecked(self.replica, digests, medium)

    def _medium(self, name: str | None) -> _Medium:
        """How an event's medium is filed: its bit named once, in order of appearance (the
        names past the last bit share it)."""
        medium = canonical_medium(name)
        bit = self._bits.get(medium)
        if bit is None:
            bit = 1 << min(len(self._bits), _MAX_MEDIA - 1)
            if len(self._bits) < _MAX_MEDIA:
                self._bits[medium] = bit
        out = _ON_GPU if bit == _GPU_BIT else _Medium(bit, index_medium(medium), True)
        self._media_of[name] = out
        return out

    def _filed_under(self, ns: Namespace) -> Namespace:
        """The namespace the service files a chain of ``ns`` under: the pinned version of its
        adapter (the events name the adapter, not its version)."""
        if ns.adapter is None:
            return ns
        version = self.versions.get((ns.model, ns.adapter))
        if version == ns.adapter_version:
            return ns
        return Namespace(ns.model, ns.adapter, version, ns.salt, ns.extra)

    def _stored(self, ev: BlockStored) -> None:
        where = self._media_of.get(ev.medium) or self._medium(ev.medium)
        bit = where.bit
        hashes = ev.block_hashes
        media = self.media
        renamed = self.renamed
        if not ev.token_ids and self.token_ids:  # another medium for blocks held already
            hashes = [h for h in hashes if h in media]
            digests = [renamed[h][0] if h in renamed else h for h in hashes]
        else:
            parent = ev.parent_block_hash
            if parent is None:
                ns = ev.namespace
                filed = self._filed_under(ns) if ns.adapter is not None else ns
                rehash = filed is not ns
                prev, pos = (self.hasher.seed(filed), 0) if rehash else (b"", 0)
            elif renamed:
                at = renamed.get(parent)
                rehash = at is not None
                prev, pos = (at[0], at[1] + 1) if at is not None else (b"", 0)
            else:
                rehash = False
            if rehash:
                assert self.token_ids, "a chain filed under another digest needs token ids"
                body = as_token_array(ev.token_ids).tobytes()
                digests = self.hasher.hash_run(body, prev, pos)
                for k, (h, d) in enumerate(zip(hashes, digests, strict=True)):
                    renamed[h] = (d, pos + k)
            else:
                digests = hashes
        get = media.get
        for h in hashes:
            media[h] = get(h, 0) | bit
        if digests:
            self._store(digests, where.index_medium)

    def _removed(self, ev: BlockRemoved) -> None:
        where = self._media_of.get(ev.medium) or self._medium(ev.medium)
        bits = where.bit
        off_gpu = where.off_gpu
        media = self.media
        renamed = self.renamed
        digests = []
        for h in ev.block_hashes:
            held = media.get(h, 0)
            if not held & bits:
                continue
            held &= ~bits
            digest = renamed[h][0] if renamed and h in renamed else h
            if held:
                media[h] = held
            else:
                del media[h]
                if renamed:
                    renamed.pop(h, None)
            if off_gpu and held & ~_GPU_BIT:  # another medium off the GPU still holds it
                continue
            digests.append(digest)
        if digests:
            self._remove(digests, where.index_medium)
