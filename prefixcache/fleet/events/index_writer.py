"""Apply one replica's decoded KV events to a fleet index.

Events carry token ids, so blocks are keyed by prefixcache's own chained digests, recomputed from
the tokens and the parent's digest: an engine's own hashes (vLLM's, SGLang's) only serve to find a
block's parent and to map removals, through the replica's map engine hash -> (digest, position,
media) (``ReplicaStream.blocks``).

The namespace of a chain's first block is the endpoint's namespace with ``adapter`` set from
``lora_name`` (when given; its version is the one a replica dedicated to that adapter pins, as
the router's clients name it) and the first block's ``extra_keys``. vLLM's keys, which
prefixcache's publisher sends too, are the LoRA name (dropped: ``lora_name`` carries it),
multimodal keys, then ``cache_salt`` on a first block: a single string left after the LoRA name
is that salt. ``(name, value)`` pairs (``adapter_version``, ``salt``, ``extra``), which
prefixcache's publisher sent before it matched vLLM, are still read. Any other keys become
``Namespace.extra`` entries, each the JSON text of one key (prompts the router cannot build, as
multimodal ones).

Only the main attention group (``group_idx`` 0 or absent) is indexed, for stores and removals
alike: a hybrid model's sliding-window group evicts blocks whose hashes equal the main group's.
Blocks of a LoRA adapter announced by ``lora_id`` alone (older vLLM layouts, SGLang) are not
indexed either: without the adapter's name they cannot be told from the base model's. Both are
counted as skipped, not as errors.
Media are read case-insensitively: ``GPU`` (or none given), host memory (``CPU``, SGLang's
``CPU_PINNED``, Mooncake's ``cpu``), ``STORAGE``, and any other name, kept as a medium of its own.
The replica's map keeps which of them hold each block; the index tells GPU from anywhere else
(its ``CPU`` is "off the GPU"): a block leaves the index's off-GPU medium when the last of the
replica's other media drops it. ``STORE`` events of a replica attached to a shared K/V store
(``kv_store``) speak of the store, not the replica: store_blocks.py. A ``BlockStored`` without
token ids (the placeholders vLLM's offload connectors send, ``block_size`` 0, and stores whose
tokens were not at hand) adds its medium to blocks the replica already holds; unknown ones are
counted as malformed.

A run stored under a parent never seen (the subscriber joined late, restarted, or cleared the
replica after an unfillable gap) is held all the same: it is kept by engine hash
(``unplaced``) and placed when a later event stores its parent, when a lookup finds it by the
replica's engine hashes (``place``), or when a prompt routed to the replica shows which blocks
it continues (``_link``: the blocks above the parent are indexed without their engine hashes
and leave the index at the first removal of a hash never seen).

An event that does not fit (wrong block size, token count, too many tokens, a block hash
repeated in it, a parent among its own blocks) is counted as malformed and logged; nothing else
changes. A block hash stored again under another parent (another digest) stands for
the new block only: the old digest leaves the index, so the engine's removal of that hash leaves
nothing behind.

With a shared engine map (``SharedEngineMap``, kept by a Redis index), every stored block's engine
hash is remembered there and forgotten once the replica holds it nowhere; a replica joined midway
(``ReplicaStream.inherited``) reads there, when it joins, every block the replica holds
(``adopt``), and looks up any other block an event names that was stored before this subscriber
came, so their removals and continuations apply as if it had seen them stored (counted as
recalled), and the index's local view holds them while Redis is away. An event whose lookup the
index cannot answer now (away) is not applied: ``apply`` says which.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import msgspec

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import as_token_array
from prefixcache.errors import InvalidTokensError
from prefixcache.fleet.events.replica_stream import ReplicaStream, block_hash_of_key, engine_key
from prefixcache.fleet.events.store_blocks import SharedStoreBlocks
from prefixcache.fleet.events.tenant_tally import tenant_of
from prefixcache.fleet.events.wire import BlockHash, RemovedBlocks, StoredBlocks
from prefixcache.fleet.index.interface import FleetIndex, SharedEngineMap
from prefixcache.medium import CPU, GPU, STORAGE, STORE

log = logging.getLogger(__name__)

_ALIASES = {"CPU_PINNED": CPU}  # SGLang's host memory
_FIXED_BITS = {GPU: 1, CPU: 2, STORAGE: 4}  # GPU and CPU as the shared engine map keeps them
_GPU = _FIXED_BITS[GPU]
_MAX_MEDIA = 24  # media told apart per replica; further names share the last bit
_ALL_MEDIA = -1
_OWN_KEYS = ("adapter_version", "salt", "extra")


def _held(rep: ReplicaStream) -> AbstractContextManager[None]:
    """The caller's lock stays held around a read of the shared engine map."""
    return nullcontext()


def canonical_medium(medium: str | None) -> str:
    """The medium a wire ``medium`` names: upper-cased, ``CPU_PINNED`` as ``CPU``, GPU for
    None."""
    if medium is None:
        return GPU
    name = medium.upper()
    return _ALIASES.get(name, name)


def index_medium(medium: str) -> str:
    """The index's medium for one of a replica's: GPU, or off the GPU (``CPU``)."""
    return GPU if medium == GPU else CPU


class EventApplier:
    """Applies events of followed replicas to ``index`` (and to ``engine_map``, when the index
    keeps one). The caller serialises the calls (the subscriber's lock)."""

    def __init__(
        self,
        index: FleetIndex,
        engine_map: SharedEngineMap | None,
        *,
        max_blocks_per_replica: int,
        max_tokens_per_event: int,
    ) -> None:
        self.index = index
        self.engine_map = engine_map
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_tokens_per_event = max_tokens_per_event
        # (model, adapter) -> the version the fleet pins (``pinned_adapter_versions``)
        self.versions: dict[tuple[str, str], str] = {}
        self._bits = dict(_FIXED_BITS)
        self.stores = SharedStoreBlocks(index, max_blocks_per_replica)  # kv_store's holders
        # around each read of the shared engine map (a network call): the subscriber lets its
        # lock go there
        self.unlocked: Callable[[ReplicaStream], AbstractContextManager[None]] = _held

    def _bit(self, medium: str) -> int:
        """The bit of ``medium`` in a block's media mask (``ReplicaStream.blocks``)."""
        bit = self._bits.get(medium)
        if bit is None:
            bit = 1 << min(len(self._bits), _MAX_MEDIA - 1)
            if len(self._bits) < _MAX_MEDIA:
                self._bits[medium] = bit
                log.info("medium %r is kept as a medium of its own", medium)
        return bit

    def apply(self, rep: ReplicaStream, events: Sequence[Any]) -> int | None:
        """Apply ``events`` in order; the index of the first that needs a lookup the shared
        index cannot answer now (nothing of it applied), or None when all were applied."""
        try:
            for k, event in enumerate(events):
                if isinstance(event, StoredBlocks):
                    done = self._stored(rep, event)
                elif isinstance(event, RemovedBlocks):
                    done = self._removed(rep, event)
                else:
                    self.clear(rep)
                    done = True
                if not done:
                    return k
                rep.counts.events += 1
            return None
        finally:
            rep.tenants.end_batch()  # its evictions, told apart by whose stores came with them

    def clear(self, rep: ReplicaStream) -> None:
        """The replica holds nothing any more: cleared here and in the index, and counted."""
        rep.blocks.clear()
        rep.inherited = False  # the index holds nothing of it either
        rep.skipped_hashes.clear()
        rep.unplaced.clear()
        rep.hashless.clear()
        rep.tenants.clear()
        self.index.clear(rep.ep.name)
        rep.counts.cleared += 1

    def _stored(self, rep: ReplicaStream, ev: StoredBlocks) -> bool:
        name = rep.ep.name
        n = len(ev.block_hashes)
        p = rep.ep.block_size
        medium = canonical_medium(ev.medium)
        if medium == STORE and rep.ep.kv_store is not None:  # in the store, not on the replica
            self.stores.stored(rep, rep.ep.kv_store, ev.block_hashes)
            return True
        problem = None
        if ev.group_idx not in (None, 0) or (ev.lora_id is not None and ev.lora_name is None):
            rep.counts.skipped += n  # by rule: another group's copy, or a LoRA of unknown name
            if rep.inherited and ev.group_idx in (None, 0):  # its removals need no lookup
                rep.skipped_hashes.update(ev.block_hashes)
            return True
        if not ev.token_ids and n and ev.block_size in (0, p):  # a placeholder
            return self._stored_known(rep, ev, medium)
        if ev.block_size != p:
            problem = f"block_size {ev.block_size}, expected {p}"
        elif len(ev.token_ids) > self.max_tokens_per_event:
            problem = f"{len(ev.token_ids)} tokens (max_tokens_per_event)"
        elif len(ev.token_ids) != n * p:
            problem = f"{len(ev.token_ids)} tokens for {n} blocks of {p}"
        elif len(set(ev.block_hashes)) != n:
            problem = "a block hash repeated in one event"
        elif ev.parent_block_hash is not None and ev.parent_block_hash in ev.block_hashes:
            problem = "a block given as its own parent (or a descendant's)"
        if problem is None:
            try:
                body = as_token_array(ev.token_ids, allow_empty=True).tobytes()
            except InvalidTokensError as exc:
                problem = str(exc)
        tenant = rep.tenants.tenant(ev.parent_block_hash)  # a chain continues its parent's
        if problem is None and ev.parent_block_hash is None:
            namespace = self._namespace(rep, ev)
            prev, pos, tenant = rep.hasher.seed(namespace), 0, tenant_of(namespace.salt)
        elif problem is None:
            parent = rep.blocks.get(ev.parent_block_hash)  # type: ignore[arg-type]
            if parent is None and rep.inherited:
                if not self._recall(rep, [ev.parent_block_hash]):  # type: ignore[list-item]
                    return False
                parent = rep.blocks.get(ev.parent_block_hash)  # type: ignore[arg-type]
            if parent is not None:
                prev, pos = parent[0], parent[1] + 1
            else:
                linked = None if rep.engine is not None else self._link(rep, ev, body)
                if linked is None:  # kept until something places it (``unplaced``)
                    self._keep_unplaced(rep, ev, body, medium)
                    return True
                prev, pos = linked
        if problem is not None:
            rep.counts.malformed += 1
            rep.last_problem = problem
            log.warning("replica %s: stored event skipped: %s", name, problem)
            return True
        bit = self._bit(medium)
        blocks = rep.blocks
        chain = rep.hasher.hash_run(body, prev, pos)  # ours, one per engine hash
        digests = []
        for k, (h, digest) in enumerate(zip(ev.block_hashes, chain, strict=True)):
            entry = blocks.get(h)
            if entry is None:
                if len(blocks) >= self.max_blocks_per_replica:
                    rep.counts.overflow += n - k
                    break
                blocks[h] = [digest, pos + k, bit]
            elif entry[0] != digest:  # stored again under another parent: the old block goes
                self.index.remove(name, [entry[0]], None)
                rep.tenants.removed(h)
                entry[0], entry[1], entry[2] = digest, pos + k, bit
            else:
                entry[1], entry[2] = pos + k, entry[2] | bit
            if bit == _GPU:
                rep.tenants.added(h, tenant)
            digests.append(digest)
        self.index.store(name, digests, index_medium(medium))
        if self.engine_map is not None:
            keys = [engine_key(h) for h in ev.block_hashes[: len(digests)]]
            self.engine_map.remember(name, keys, digests, pos)
        rep.counts.blocks_stored += len(digests)
        if rep.hashless:
            rep.hashless.difference_update(digests)
        if rep.unplaced.entries:
            for h in ev.block_hashes[: len(digests)]:
                rep.unplaced.pop(h)  # placed now (its unplaced children follow)
            if rep.unplaced.children:
                self._place_children(rep, ev.block_hashes[: len(digests)])
        return True

    def _stored_known(self, rep: ReplicaStream, ev: StoredBlocks, medium: str) -> bool:
        """A store without tokens: another medium for blocks the replica holds already."""
        bit, blocks = self._bit(medium), rep.blocks
        if rep.inherited and not self._recall(rep, ev.block_hashes):
            return False
        digests = []
        for h in ev.block_hashes:
            entry = blocks.get(h)
            if entry is not None:
                entry[2] |= bit
                digests.append(entry[0])
        if len(digests) < len(ev.block_hashes):
            rep.counts.malformed += 1
            log.warning(
                "replica %s: %d of %d blocks stored without tokens are unknown; skipped",
                rep.ep.name,
                len(ev.block_hashes) - len(digests),
                len(ev.block_hashes),
            )
        if digests:
            self.index.store(rep.ep.name, digests, index_medium(medium))
            rep.counts.blocks_stored += len(digests)
        return True

    def _removed(self, rep: ReplicaStream, ev: RemovedBlocks) -> bool:
        if ev.group_idx not in (None, 0):  # another group's copy of the same hashes
            return True
        medium = None if ev.medium is None else canonical_medium(ev.medium)
        if medium == STORE and rep.ep.kv_store is not None:
            self.stores.removed(rep, rep.ep.kv_store, ev.block_hashes)
            return True
        bits = _ALL_MEDIA if medium is None else self._bit(medium)
        off_gpu = medium is not None and medium != GPU
        blocks = rep.blocks
        if rep.inherited and not self._recall(rep, ev.block_hashes):
            return False
        digests, gone = [], []
        unplaced, now = rep.unplaced, rep.counts.events
        for h in ev.block_hashes:
            entry = blocks.get(h)
            seen = entry is not None or h in unplaced.entries
            if unplaced:
                unplaced.removed(h, bits, now)
            if not seen and rep.hashless:
                # a hash never seen: maybe one of the blocks indexed without their hashes
                self.index.remove(rep.ep.name, list(rep.hashless), None)
                rep.counts.blocks_removed += len(rep.hashless)
                rep.hashless.clear()
            if entry is None or not entry[2] & bits:
                continue
            if entry[2] & bits & _GPU:
                rep.tenants.removed(h)
            entry[2] &= ~bits
            if not entry[2]:
                del blocks[h]
                gone.append(h)
            if off_gpu and entry[2] & ~1:  # another medium off the GPU still holds it
                rep.counts.blocks_removed += 1
                continue
            digests.append(entry[0])
        self.index.remove(rep.ep.name, digests, None if medium is None else index_medium(medium))
        if rep.skipped_hashes:
            rep.skipped_hashes.difference_update(ev.block_hashes)
        if self.engine_map is not None and gone:
            self.engine_map.forget(rep.ep.name, [engine_key(h) for h in gone])
        rep.counts.blocks_removed += len(digests)
        return True

    # ---- blocks stored under a parent never seen (``unplaced``) --------------------------

    def _keep_unplaced(
        self, rep: ReplicaStream, ev: StoredBlocks, body: bytes, medium: str
    ) -> None:
        """Keep a run stored under an unknown parent by engine hash until it can be placed."""
        for h in ev.block_hashes:  # stored again under another parent: the old block goes
            entry = rep.blocks.pop(h, None)
            if entry is not None:
                self.index.remove(rep.ep.name, [entry[0]], None)
                if self.engine_map is not None:
                    self.engine_map.forget(rep.ep.name, [engine_key(h)])
        assert ev.parent_block_hash is not None
        missed = rep.unplaced.keep(
            ev.block_hashes,
            ev.parent_block_hash,
            body,
            4 * rep.ep.block_size,
            self._bit(medium),
            rep.counts.events,
            ev.lora_name,
        )
        rep.counts.unplaced += len(ev.block_hashes) - missed
        rep.counts.overflow += missed

    def _link(self, rep: ReplicaStream, ev: StoredBlocks, body: bytes) -> tuple[bytes, int] | None:
        """A prompt routed to the replica whose blocks ``j..`` the event stores places its
        parent (and the unplaced blocks above it) as the prompt's blocks ``..j-1``: (digest of
        block ``j-1``, ``j``), or None when no routed prompt fits."""
        bb = 4 * rep.ep.block_size
        found = rep.routes.find(body, bb, ev.lora_name)
        if found is None:
            return None
        prompt, digests, j = found
        h: BlockHash | None = ev.parent_block_hash
        pos = j - 1
        entries = rep.unplaced.entries
        while h is not None and h in entries:  # unplaced ancestors: the prompt must fit them
            entry = entries[h]
            if pos < 0 or entry[1] != prompt[pos * bb : (pos + 1) * bb]:
                return None
            h, pos = entry[0], pos - 1
        if h is None or pos < 0:
            return None
        name = rep.ep.name
        rep.hashless.update(digests[:pos])  # held (the request used them), hashes unknown
        self.index.store(name, digests[:pos], GPU)
        self.place(rep, [h], [digests[pos]], [1], pos)  # and the unplaced blocks below it
        rep.counts.placed_late += pos
        return digests[j - 1], j

    def place(
        self,
        rep: ReplicaStream,
        hashes: Sequence[BlockHash],
        digests: Sequence[bytes],
        media: Sequence[int],
        position: int = 0,
        *,
        follow: bool = True,
    ) -> int:
        """Place blocks a lookup or a link found held: ``hashes[k]`` is the block ``digests[k]``
        at ``position + k``, held on ``media[k]`` (a mask; an unplaced block keeps its own).
        Stops at a block placed under another digest (another namespace); the blocks placed."""
        blocks, name = rep.blocks, rep.ep.name
        gpu: list[bytes] = []
        off: list[bytes] = []
        placed: list[BlockHash] = []
        at: list[int] = []  # their positions
        for k, (h, d) in enumerate(zip(hashes, digests, strict=False)):
            entry = blocks.get(h)
            if entry is not None:
                if entry[0] != d:
                    break
                continue
            if len(blocks) >= self.max_blocks_per_replica:
                rep.counts.overflow += 1
                break
            kept = rep.unplaced.pop(h)
            bits = kept[2] if kept is not None else media[k]
            blocks[h] = [d, position + k, bits]
            if bits & 1:
                gpu.append(d)
            if bits & ~1:
                off.append(d)
            placed.append(h)
            at.append(position + k)
        self.index.store(name, gpu, GPU)
        self.index.store(name, off, CPU)
        if self.engine_map is not None:  # one call per run of consecutive positions
            start = 0
            for k in range(1, len(placed) + 1):
                if k == len(placed) or at[k] != at[k - 1] + 1:
                    run = placed[start:k]
                    keys = [engine_key(h) for h in run]
                    self.engine_map.remember(name, keys, [blocks[h][0] for h in run], at[start])
                    start = k
        rep.counts.placed_late += len(placed)
        if follow and rep.unplaced.children:
            self._place_children(rep, placed)
        return len(placed)

    def _place_children(self, rep: ReplicaStream, parents: Sequence[BlockHash]) -> None:
        """Place the unplaced blocks stored under ``parents`` (now placed), and theirs."""
        todo = list(parents)
        children = rep.unplaced.children
        while todo:
            parent = todo.pop()
            kids = children.get(parent)
            entry = rep.blocks.get(parent)
            if not kids or entry is None:
                continue
            for h in list(kids):
                kept = rep.unplaced.entries[h]
                (digest,) = rep.hasher.hash_run(kept[1], entry[0], entry[1] + 1)
                if self.place(rep, [h], [digest], [kept[2]], entry[1] + 1, follow=False):
                    todo.append(h)

    def adopt(self, rep: ReplicaStream) -> None:
        """Joining a stream that other routers applied: every block the shared engine map says
        the replica holds becomes known at once (counted as recalled), so removals and
        continuations of them need no lookup, and the index's local view holds them."""
        assert self.engine_map is not None
        blocks = rep.blocks
        with self.unlocked(rep):
            found = self.engine_map.adopt(rep.ep.name, self.max_blocks_per_replica - len(blocks))
        for key, block in (found or {}).items():
            h = block_hash_of_key(key)
            if h is None or h in blocks:
                continue  # a long hash's digest: recalled when an event names it
            if len(blocks) >= self.max_blocks_per_replica:
                break
            blocks[h] = [block.digest, block.position, block.media]
            rep.counts.recalled += 1

    def _recall(self, rep: ReplicaStream, hashes: Sequence[BlockHash]) -> bool:
        """Blocks of ``hashes`` unknown here that the shared engine map remembers (stored before
        this subscriber joined the stream) become known, where the replica still holds them."""
        assert self.engine_map is not None
        skipped = rep.skipped_hashes
        unknown = {engine_key(h): h for h in hashes if h not in rep.blocks and h not in skipped}
        if not unknown:
            return True
        with self.unlocked(rep):
            found = self.engine_map.recall(rep.ep.name, list(unknown))
        if found is None:  # the index cannot say now (away): the event waits (False)
            return False
        blocks, cap = rep.blocks, self.max_blocks_per_replica
        for key, block in found.items():
            h = unknown[key]  # placed by a lookup meanwhile, it stays as placed
            if block.media and h not in blocks and len(blocks) < cap:
                blocks[h] = [block.digest, block.position, block.media]
                rep.counts.recalled += 1
        return True

    def _namespace(self, rep: ReplicaStream, ev: StoredBlocks) -> Namespace:
        ns = rep.ep.namespace
        adapter = ev.lora_name if ev.lora_name is not None else ns.adapter
        # the replica's own adapter has its version; another one the version the fleet pins
        if adapter == ns.adapter:
            version = ns.adapter_version
        else:
            version = None if adapter is None else self.versions.get((ns.model, adapter))
        keys = list(ev.extra_keys[0] or ()) if ev.extra_keys else []
        if keys and ev.lora_name is not None and keys[0] == ev.lora_name:
            keys = keys[1:]  # vLLM also hashes the LoRA name as a block's first key
        salt = ev.cache_salt  # SGLang's field
        if not keys and salt is None:
            if adapter == ns.adapter:
                return ns
            return Namespace(ns.model, adapter, version, ns.salt, ns.extra)
        fields: dict[str, Any] = {"adapter_version": version, "salt": ns.salt}
        extra: list[str] = list(ns.extra)
        for k in keys:
            if isinstance(k, str) and salt is None:  # vLLM's cache_salt
                salt = k
            elif (
                isinstance(k, (list, tuple))
                and len(k) == 2
                and k[0] in _OWN_KEYS
                and isinstance(k[1], str)
            ):
                if k[0] == "extra":
                    extra.append(k[1])
                else:
                    fields[k[0]] = k[1]
            else:
                extra.append(msgspec.json.encode(k).decode())
        if salt is not None:
            fields["salt"] = salt
        return Namespace(ns.model, adapter, fields["adapter_version"], fields["salt"], tuple(extra))
