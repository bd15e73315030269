"""Ingest KV event streams from many replicas into a fleet index.

One ``ReplicaEndpoint`` per replica (an engine's data-parallel rank): its event endpoint, its
optional replay endpoint, the namespace its blocks live in, its block size. Events carry token
ids, so blocks are keyed by prefixcache's own chained digests, recomputed from the tokens and the
parent's digest: an engine's own hashes (vLLM's, SGLang's) only serve to find a block's parent
and to map removals, through a per-replica map engine hash -> (digest, position, media).

The namespace of a chain's first block is the endpoint's namespace with ``adapter`` set from
``lora_name`` (when given; its version is the one a replica dedicated to that adapter pins, as
the router's clients name it) and the first block's ``extra_keys``: prefixcache's publisher sends
``(name, value)`` pairs (``adapter_version``, ``salt``, ``extra``). vLLM's keys are the LoRA name
(dropped: ``lora_name`` carries it), multimodal keys, then ``cache_salt`` on a first block: a
single string left after the LoRA name is that salt. Any other keys become ``Namespace.extra``
entries, each the JSON text of one key (prompts the router cannot build, as multimodal ones).

Only the main attention group (``group_idx`` 0 or absent) is indexed, for stores and removals
alike: a hybrid model's sliding-window group evicts blocks whose hashes equal the main group's.
Blocks of a LoRA adapter announced by ``lora_id`` alone (older vLLM layouts, SGLang) are not
indexed either: without the adapter's name they cannot be told from the base model's. Both are
counted as skipped, not as errors.
A ``BlockStored`` without token ids (vLLM's CPU offload announces blocks it copied from the GPU
that way) adds its medium to blocks the replica already holds; unknown ones are skipped.

Sequence rules, per replica:

- the next number: the batch is applied;
- a jump forward (a gap, or a first batch after 0): the gap is counted, the missing batches are
  fetched from the replay endpoint and applied first; if there is no replay endpoint, or it no
  longer has them all, the replica is cleared (its entries may be stale) before applying. The
  first batch this subscriber sees of a replica is the exception: what the index already holds
  for it came from other routers sharing the index (or from before a router restart), so it is
  kept; an index that keeps a shared engine map (Redis: ``SharedEngineMap``) names the last
  batch applied to it, so only the batches after it are a gap (cleared when unfilled, as
  above), tells a restarted engine (an applied number on a newer batch, or the replay of the
  last applied batch stamped otherwise: cleared, its earlier batches a gap), and maps the
  engine hashes of blocks stored before, so their removals and continuations apply as if this
  subscriber had seen them stored (counted as recalled). While the index cannot be asked (Redis
  away), an event that needs such a lookup waits, and every later event of the replica with
  it, in stream order, until the index answers (at most ``max_deferred_events``, then the
  replica is cleared);
- a number at or below the last one: the publisher restarted; the replica is cleared and
  counted as a reset, then the new stream's batches before this one count as a gap (above);
- ``AllBlocksCleared`` clears the replica.

A message that does not decode, or an event that does not fit (wrong block size, token count,
unknown parent, too many tokens), is counted and logged; its sequence number still counts (the
next message is no gap), nothing else changes.

Readers of the counters (metrics scrapes) never wait for the ingestion, which may be waiting on a
replay endpoint: they read a snapshot without its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import xxhash
import zmq

from prefixcache.errors import (
    ConfigError,
    FleetCapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    WireFormatError,
)
from prefixcache.fleet.fleet_index import CPU, GPU, AppliedBatch, FleetIndex, SharedEngineMap
from prefixcache.fleet.ingest import IngestCounts
from prefixcache.fleet.kv_wire import (
    END_SEQ,
    BatchDecoder,
    BlockHash,
    RemovedBlocks,
    StoredBlocks,
    decode_seq,
    encode_seq,
)
from prefixcache.fleet.router import pinned_adapter_versions
from prefixcache.hashing import BlockHasher
from prefixcache.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.tokens import as_token_array

log = logging.getLogger(__name__)

_MEDIA = {None: GPU, "GPU": GPU, "CPU": CPU}
_BIT = {GPU: 1, CPU: 2}
_OWN_KEYS = ("adapter_version", "salt", "extra")


@dataclass(frozen=True)
class ReplicaEndpoint:
    """Where one replica publishes, and how to read its blocks."""

    name: str
    endpoint: str | None = None  # PUB endpoint to connect to; None: fed through ingest() only
    replay_endpoint: str | None = None  # ROUTER endpoint for missed batches
    namespace: Namespace = DEFAULT_NAMESPACE  # model (and salt) of its blocks
    block_size: int = 16
    topic: str = ""
    hash_algo: str = "xxh3_128"


class ReplicaCounters(NamedTuple):
    """What one replica's stream has brought."""

    batches: int  # batches applied (replayed ones included)
    events: int  # events applied
    blocks_stored: int
    blocks_removed: int
    gaps: int  # jumps forward in the sequence
    replays: int  # replay requests that filled a gap
    malformed: int  # messages or events that did not fit
    resets: int  # sequence numbers that went back (publisher restarts)
    cleared: int  # times the replica was cleared (AllBlocksCleared, reset, unfilled gap)
    overflow: int  # blocks not tracked because the replica was at max_blocks_per_replica
    skipped: int  # blocks not indexed by rule (other attention groups, nameless LoRA blocks)
    recalled: int  # blocks stored before this subscriber joined, found in the shared map
    last_seq: int  # -1 before the first batch


@dataclass
class _Counts:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    gaps: int = 0
    replays: int = 0
    malformed: int = 0
    resets: int = 0
    cleared: int = 0
    overflow: int = 0
    skipped: int = 0
    recalled: int = 0


@dataclass
class _Replica:
    ep: ReplicaEndpoint
    hasher: BlockHasher
    blocks: dict[BlockHash, list[Any]] = field(default_factory=dict)  # [digest, pos, media]
    last_seq: int = -1
    seen: bool = False  # a batch of this replica came in since it was followed
    # joined midway: the index may hold blocks stored before, known only to a shared engine map
    inherited: bool = False
    skipped_hashes: set[BlockHash] = field(default_factory=set)  # while inherited
    # events waiting, in stream order, for a lookup the shared index could not answer (away)
    deferred: list[list[Any]] = field(default_factory=list)
    counts: _Counts = field(default_factory=_Counts)


class KVEventSubscriber:
    """Feeds ``index`` from the replicas' event streams (``start()`` runs a poller thread) or
    from bytes handed to ``ingest()``."""

    def __init__(
        self,
        index: FleetIndex,
        endpoints: Iterable[ReplicaEndpoint] = (),
        *,
        max_replicas: int = 1024,
        max_blocks_per_replica: int = 4_000_000,
        max_tokens_per_event: int = 1 << 20,
        replay_timeout: float = 2.0,
        max_deferred_events: int = 100_000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.index = index
        self.max_replicas = max_replicas
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_tokens_per_event = max_tokens_per_event
        self.replay_timeout = replay_timeout
        self.max_deferred_events = max_deferred_events
        self._ctx = context or zmq.Context.instance()
        self._decoder = BatchDecoder()
        self._lock = threading.RLock()
        self._replicas: dict[str, _Replica] = {}
        self._versions: dict[tuple[str, str], str] = {}  # (model, adapter) -> pinned version
        self._engine_map = index if isinstance(index, SharedEngineMap) else None
        if self._engine_map is not None:
            self._engine_map.attach_engine_source(self._engine_entries)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for ep in endpoints:
            self.add_replica(ep)

    # ---- replicas -------------------------------------------------------------------------
    def add_replica(self, ep: ReplicaEndpoint) -> None:
        """Follow one more replica (picked up by a running poller within its next poll)."""
        if not isinstance(ep, ReplicaEndpoint):
            raise InvalidArgumentError(f"expected a ReplicaEndpoint, got {type(ep).__name__}")
        if not isinstance(ep.name, str) or not ep.name or len(ep.name) > 256:
            raise InvalidArgumentError(
                f"replica name must be a non-empty str of at most 256 characters: {ep.name!r}"
            )
        hasher = BlockHasher(ep.block_size, ep.hash_algo)  # validates both
        with self._lock:
            if ep.name in self._replicas:
                raise InvalidArgumentError(f"replica {ep.name!r} is already followed")
            if len(self._replicas) >= self.max_replicas:
                raise FleetCapacityError(
                    f"already following {self.max_replicas} replicas (max_replicas)"
                )
            self._replicas[ep.name] = _Replica(ep, hasher)
            self._pin_versions()

    def remove_replica(self, name: str) -> None:
        """Stop following ``name`` and drop it from the index."""
        with self._lock:
            if self._replicas.pop(name, None) is None:
                raise InvalidArgumentError(f"replica {name!r} is not followed")
            self._pin_versions()
            self.index.drop_replica(name)

    def _pin_versions(self) -> None:
        self._versions = pinned_adapter_versions(r.ep.namespace for r in self._replicas.values())

    def counters(self) -> dict[str, ReplicaCounters]:
        """Per-replica counters, a snapshot (taken without waiting for the ingestion)."""
        replicas = sorted(self._replicas.items())  # a copy made in one step
        return {
            name: ReplicaCounters(**vars(rep.counts), last_seq=rep.last_seq)
            for name, rep in replicas
        }

    def ingest_counts(self) -> dict[str, IngestCounts]:
        """The counters in the service's terms (``prefixcache.fleet.ingest.IngestStats``); a
        snapshot taken without waiting for the ingestion."""
        return {
            name: IngestCounts(
                events=rep.counts.batches,
                blocks_stored=rep.counts.blocks_stored,
                blocks_removed=rep.counts.blocks_removed,
                sequence_gaps=rep.counts.gaps,
                errors=rep.counts.malformed,
                blocks_skipped=rep.counts.skipped,
                blocks_recalled=rep.counts.recalled,
            )
            for name, rep in sorted(self._replicas.items())  # a copy made in one step
        }

    # ---- ingestion ------------------------------------------------------------------------
    def ingest(self, replica: str, seq: int, payload: bytes) -> int:
        """Apply one message of ``replica`` (sequence ``seq``); the batches applied (replayed
        ones included, not a malformed message, which is counted)."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None:
                raise InvalidArgumentError(f"replica {replica!r} is not followed")
            if isinstance(seq, bool) or not isinstance(seq, int):
                raise InvalidArgumentError(f"seq must be an int, got {seq!r}")
            return self._ingest(rep, seq, payload)

    def _ingest(self, rep: _Replica, seq: int, payload: bytes) -> int:
        ts: float | None = None
        try:
            batch = self._decoder.decode(payload)
            events: Sequence[Any] | None = batch.events
            ts = batch.ts
        except WireFormatError as exc:
            rep.counts.malformed += 1
            log.warning("replica %s: malformed batch %d: %s", rep.ep.name, seq, exc)
            events = None  # lost, but its number counts: the next batch is no gap
        applied = 0
        known: AppliedBatch | None = None
        if not rep.seen and self._engine_map is not None:
            # joining: the index holds what other routers (or this one before a restart)
            # applied, up to the batch it names; only the batches after it are missing
            known = self._engine_map.last_applied(rep.ep.name)
            rep.inherited = seq > 0
            if known is not None and self._new_stream(rep, known, seq, ts):
                # the engine restarted since: its earlier blocks are gone, and the new
                # stream's first batches are a gap
                rep.counts.resets += 1
                log.info(
                    "replica %s: a new stream since batch %d was applied; clearing",
                    rep.ep.name,
                    known.seq,
                )
                self._restart(rep)
                known = None
            elif known is not None:
                rep.last_seq = min(known.seq, seq - 1)
        elif seq <= rep.last_seq:
            rep.counts.resets += 1
            log.info("replica %s: sequence went back to %d; clearing", rep.ep.name, seq)
            self._restart(rep)
            rep.last_seq = -1  # batches 0 .. seq-1 of the new stream are a gap
        if seq > rep.last_seq + 1:
            rep.counts.gaps += 1
            missed = self._replay(rep, rep.last_seq + 1, seq)
            if missed is None and known is not None and not self._applied_since(rep, seq):
                log.warning(
                    "replica %s: batches %d..%d lost by every router; clearing",
                    rep.ep.name,
                    rep.last_seq + 1,
                    seq - 1,
                )
                self._restart(rep)
            elif missed is None and not rep.seen:
                log.info(
                    "replica %s: joined its stream at batch %d; batches %d..%d not replayed, "
                    "the index keeps what it holds",
                    rep.ep.name,
                    seq,
                    rep.last_seq + 1,
                    seq - 1,
                )
            elif missed is None:
                log.warning(
                    "replica %s: batches %d..%d lost; clearing",
                    rep.ep.name,
                    rep.last_seq + 1,
                    seq - 1,
                )
                self._restart(rep)
            else:
                rep.counts.replays += 1
                for s, p in missed:
                    try:
                        self._apply(rep, self._decoder.decode(p).events)
                    except WireFormatError as exc:
                        rep.counts.malformed += 1
                        log.warning(
                            "replica %s: malformed replayed batch %d: %s", rep.ep.name, s, exc
                        )
                    applied += 1
        rep.seen = True
        rep.last_seq = seq
        if events is not None:
            self._apply(rep, events)
            applied += 1
        if self._engine_map is not None and ts is not None and not rep.deferred:
            self._engine_map.note_applied(rep.ep.name, seq, ts)
        return applied

    def _apply(self, rep: _Replica, events: Sequence[Any]) -> None:
        rep.counts.batches += 1
        if rep.deferred:  # in stream order: after the events still waiting
            rep.deferred.append(list(events))
            self._drain(rep)
        else:
            k = self._apply_events(rep, events)
            if k is not None:
                log.warning(
                    "replica %s: the shared index cannot be asked about blocks stored before "
                    "this router joined; events wait until it answers",
                    rep.ep.name,
                )
                rep.deferred.append(list(events[k:]))
        waiting = sum(len(batch) for batch in rep.deferred) if rep.deferred else 0
        if waiting > self.max_deferred_events:
            log.warning("replica %s: %d events waited too long; clearing", rep.ep.name, waiting)
            self._restart(rep)

    def _apply_events(self, rep: _Replica, events: Sequence[Any]) -> int | None:
        """Apply ``events`` in order; the index of the first that needs a lookup the shared
        index cannot answer now (nothing of it applied), or None when all were applied."""
        for k, event in enumerate(events):
            if isinstance(event, StoredBlocks):
                done = self._stored(rep, event)
            elif isinstance(event, RemovedBlocks):
                done = self._removed(rep, event)
            else:
                self._clear(rep)
                done = True
            if not done:
                return k
            rep.counts.events += 1
        return None

    def _drain(self, rep: _Replica) -> None:
        """Apply the waiting events, in order, as far as the shared index answers."""
        while rep.deferred:
            events = rep.deferred.pop(0)
            k = self._apply_events(rep, events)
            if k is not None:
                rep.deferred.insert(0, events[k:])
                return

    def _restart(self, rep: _Replica) -> None:
        """Clear the replica for a stream that restarted or lost batches: the events still
        waiting came before, and go too."""
        rep.deferred = []
        self._clear(rep)

    def _stored(self, rep: _Replica, ev: StoredBlocks) -> bool:
        name = rep.ep.name
        n = len(ev.block_hashes)
        p = rep.ep.block_size
        medium = _MEDIA.get(ev.medium)
        problem = None
        if ev.group_idx not in (None, 0) or (ev.lora_id is not None and ev.lora_name is None):
            rep.counts.skipped += n  # by rule: another group's copy, or a LoRA of unknown name
            if rep.inherited and ev.group_idx in (None, 0):  # its removals need no lookup
                rep.skipped_hashes.update(ev.block_hashes)
            return True
        if medium is None:
            problem = f"medium {ev.medium!r}"
        elif ev.block_size != p:
            problem = f"block_size {ev.block_size}, expected {p}"
        elif not ev.token_ids and n:
            return self._stored_known(rep, ev, medium)
        elif len(ev.token_ids) > self.max_tokens_per_event:
            problem = f"{len(ev.token_ids)} tokens (max_tokens_per_event)"
        elif len(ev.token_ids) != n * p:
            problem = f"{len(ev.token_ids)} tokens for {n} blocks of {p}"
        if problem is None:
            try:
                body = as_token_array(ev.token_ids, allow_empty=True).tobytes()
            except InvalidTokensError as exc:
                problem = str(exc)
        if problem is None and ev.parent_block_hash is None:
            prev, pos = rep.hasher.seed(self._namespace(rep, ev)), 0
        elif problem is None:
            parent = rep.blocks.get(ev.parent_block_hash)  # type: ignore[arg-type]
            if parent is None and rep.inherited:
                if not self._recall(rep, [ev.parent_block_hash]):  # type: ignore[list-item]
                    return False
                parent = rep.blocks.get(ev.parent_block_hash)  # type: ignore[arg-type]
            if parent is None:
                problem = "unknown parent block"
            else:
                prev, pos = parent[0], parent[1] + 1
        if problem is not None:
            rep.counts.malformed += 1
            log.warning("replica %s: stored event skipped: %s", name, problem)
            return True
        assert medium is not None
        bit = _BIT[medium]
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
            else:
                entry[0], entry[1], entry[2] = digest, pos + k, entry[2] | bit
            digests.append(digest)
        self.index.store(name, digests, medium)
        if self._engine_map is not None:
            keys = [_engine_key(h) for h in ev.block_hashes[: len(digests)]]
            self._engine_map.remember(name, keys, digests, pos)
        rep.counts.blocks_stored += len(digests)
        return True

    def _new_stream(self, rep: _Replica, known: AppliedBatch, seq: int, ts: float | None) -> bool:
        """Whether batch ``seq`` (stamped ``ts``) is of another stream than the last batch the
        shared index applied: a number already applied on a newer batch, or the replay of that
        batch stamped otherwise."""
        if seq <= known.seq:
            return ts is not None and ts > known.ts
        got = self._replay(rep, known.seq, known.seq + 1)
        if not got:
            return False  # no replay endpoint, or it no longer has that batch: cannot tell
        try:
            return self._decoder.decode(got[0][1]).ts != known.ts
        except WireFormatError:
            return False

    def _applied_since(self, rep: _Replica, seq: int) -> bool:
        """Whether another router applied the batches before ``seq`` meanwhile (its note of
        them may have lagged the first read); also when the index cannot say now (the note was
        there a moment ago): a clear sent later would wipe what other routers hold."""
        assert self._engine_map is not None
        again = self._engine_map.last_applied(rep.ep.name)
        return again is None or again.seq >= seq - 1

    def _engine_entries(self, name: str) -> list[tuple[bytes, bytes, int]]:
        """(engine key, digest, position) of each block ``name`` holds, as followed here: what
        a shared index writes back after losing its engine map. Safe from another thread."""
        rep = self._replicas.get(name)
        if rep is None:
            return []
        blocks = rep.blocks.copy()  # one step under the GIL: the ingestion may be running
        return [(_engine_key(h), entry[0], entry[1]) for h, entry in blocks.items()]

    def _recall(self, rep: _Replica, hashes: Sequence[BlockHash]) -> bool:
        """Blocks of ``hashes`` unknown here that the shared engine map remembers (stored before
        this subscriber joined the stream) become known, where the replica still holds them."""
        assert self._engine_map is not None
        skipped = rep.skipped_hashes
        unknown = {_engine_key(h): h for h in hashes if h not in rep.blocks and h not in skipped}
        if not unknown:
            return True
        found = self._engine_map.recall(rep.ep.name, list(unknown))
        if found is None:  # the index cannot say now (away): the event waits (False)
            return False
        for key, block in found.items():
            if block.media and len(rep.blocks) < self.max_blocks_per_replica:
                rep.blocks[unknown[key]] = [block.digest, block.position, block.media]
                rep.counts.recalled += 1
        return True

    def _stored_known(self, rep: _Replica, ev: StoredBlocks, medium: str) -> bool:
        """A store without tokens: another medium for blocks the replica holds already."""
        bit, blocks = _BIT[medium], rep.blocks
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
            self.index.store(rep.ep.name, digests, medium)
            rep.counts.blocks_stored += len(digests)
        return True

    def _removed(self, rep: _Replica, ev: RemovedBlocks) -> bool:
        if ev.group_idx not in (None, 0):  # another group's copy of the same hashes
            return True
        medium = None if ev.medium is None else _MEDIA.get(ev.medium)
        if ev.medium is not None and medium is None:
            rep.counts.malformed += 1
            log.warning("replica %s: removed event skipped: medium %r", rep.ep.name, ev.medium)
            return True
        bits = 3 if medium is None else _BIT[medium]
        blocks = rep.blocks
        if rep.inherited and not self._recall(rep, ev.block_hashes):
            return False
        digests, gone = [], []
        for h in ev.block_hashes:
            entry = blocks.get(h)
            if entry is None or not entry[2] & bits:
                continue
            entry[2] &= ~bits
            if not entry[2]:
                del blocks[h]
                gone.append(h)
            digests.append(entry[0])
        self.index.remove(rep.ep.name, digests, medium)
        if rep.skipped_hashes:
            rep.skipped_hashes.difference_update(ev.block_hashes)
        if self._engine_map is not None and gone:
            self._engine_map.forget(rep.ep.name, [_engine_key(h) for h in gone])
        rep.counts.blocks_removed += len(digests)
        return True

    def _clear(self, rep: _Replica) -> None:
        rep.blocks.clear()
        rep.inherited = False  # the index holds nothing of it either
        rep.skipped_hashes.clear()
        self.index.clear(rep.ep.name)
        rep.counts.cleared += 1

    def _namespace(self, rep: _Replica, ev: StoredBlocks) -> Namespace:
        ns = rep.ep.namespace
        adapter = ev.lora_name if ev.lora_name is not None else ns.adapter
        # the replica's own adapter has its version; another one the version the fleet pins
        if adapter == ns.adapter:
            version = ns.adapter_version
        else:
            version = None if adapter is None else self._versions.get((ns.model, adapter))
        keys = ev.extra_keys[0] if ev.extra_keys else None
        if keys and ev.lora_name is not None:  # vLLM also hashes the LoRA name as a key
            keys = [k for k in keys if k != ev.lora_name]
        if keys and len(keys) == 1 and isinstance(keys[0], str):  # vLLM's cache_salt
            return Namespace(ns.model, adapter, version, keys[0], ns.extra)
        if not keys:
            if adapter == ns.adapter:
                return ns
            return Namespace(ns.model, adapter, version, ns.salt, ns.extra)
        fields: dict[str, Any] = {"adapter_version": version, "salt": ns.salt}
        extra: list[str] = list(ns.extra)
        own = all(
            isinstance(k, (list, tuple))
            and len(k) == 2
            and k[0] in _OWN_KEYS
            and isinstance(k[1], str)
            for k in keys
        )
        for k in keys:
            if not own:
                extra.append(msgspec.json.encode(k).decode())
            elif k[0] == "extra":
                extra.append(k[1])
            else:
                fields[k[0]] = k[1]
        return Namespace(ns.model, adapter, fields["adapter_version"], fields["salt"], tuple(extra))

    def _replay(self, rep: _Replica, start: int, end: int) -> list[tuple[int, bytes]] | None:
        """Batches ``start .. end-1`` from the replica's replay endpoint, or None when it has
        no replay endpoint or cannot provide them all."""
        if rep.ep.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            sock.connect(rep.ep.replay_endpoint)
            sock.send_multipart((b"", encode_seq(start)))
            while True:
                if not sock.poll(int(self.replay_timeout * 1000)):
                    log.warning("replica %s: replay timed out", rep.ep.name)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    return None
                if frames[1] == END_SEQ:
                    break
                s = decode_seq(frames[1])
                if start <= s < end:
                    got[s] = frames[2]
        except (zmq.ZMQError, WireFormatError) as exc:
            log.warning("replica %s: replay failed: %s", rep.ep.name, exc)
            return None
        finally:
            sock.close(linger=0)
        if len(got) != end - start:
            return None
        return sorted(got.items())

    # ---- the poller thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the poller thread (subscribes to every replica with an endpoint)."""
        if self._thread is not None:
            raise ConfigError("the subscriber is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kv-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the poller thread and close its sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> KVEventSubscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        poller = zmq.Poller()
        sockets: dict[str, zmq.Socket[Any]] = {}
        names: dict[Any, str] = {}
        refused: dict[str, str | None] = {}  # replica -> the endpoint ZMQ would not connect to
        flush = getattr(self.index, "flush", None)
        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = {n: r.ep for n, r in self._replicas.items() if r.ep.endpoint}
                for n in [n for n in sockets if n not in wanted]:
                    sock = sockets.pop(n)
                    poller.unregister(sock)
                    del names[sock]
                    sock.close(linger=0)
                for n, ep in wanted.items():
                    if n not in sockets and refused.get(n) != ep.endpoint:
                        sock = self._ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.setsockopt(zmq.SUBSCRIBE, ep.topic.encode("utf-8"))
                        assert ep.endpoint is not None
                        try:
                            sock.connect(ep.endpoint)
                        except zmq.ZMQError as exc:  # one bad endpoint must not stop the others
                            sock.close(linger=0)
                            refused[n] = ep.endpoint
                            with self._lock:
                                if n in self._replicas:
                                    self._replicas[n].counts.malformed += 1
                            log.error("replica %s: cannot connect to %s: %s", n, ep.endpoint, exc)
                            continue
                        sockets[n] = sock
                        names[sock] = n
                        poller.register(sock, zmq.POLLIN)
                ready = poller.poll(50)
                for sock, _ in ready:
                    name = names[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(name, frames)
                with self._lock:  # events waiting for the shared index: try again
                    for rep in self._replicas.values():
                        if rep.deferred:
                            self._drain(rep)
                if ready and flush is not None:  # a remote index: send what the round wrote
                    try:
                        flush()
                    except Exception:  # the index counts its own failures; keep ingesting
                        log.exception("flushing the fleet index failed")
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _on_message(self, name: str, frames: list[bytes]) -> None:
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None:
                return
            try:
                if len(frames) != 3:
                    raise WireFormatError(f"expected 3 frames, got {len(frames)}")
                seq = decode_seq(frames[1])
            except WireFormatError as exc:
                rep.counts.malformed += 1
                log.warning("replica %s: malformed message: %s", name, exc)
                return
            try:
                self._ingest(rep, seq, frames[2])
            except Exception:  # an index failure must not stop the poller
                rep.counts.malformed += 1
                log.exception("replica %s: batch %d not applied", name, seq)


def _engine_key(h: BlockHash) -> bytes:
    """An engine block hash as a shared engine map's key: ``i<decimal>``, ``b<bytes>``, or for
    bytes longer than 64 ``h`` and their 128-bit xxh3 digest (keys stay short)."""
    if isinstance(h, int):
        return b"i%d" % h
    raw = bytes(h)
    return b"b" + raw if len(raw) <= 64 else b"h" + xxhash.xxh3_128_digest(raw)
