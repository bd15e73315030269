"""Ingest KV event streams from many replicas into a fleet index: the stream intake.

One ``ReplicaEndpoint`` per replica (an engine's data-parallel rank): its event endpoint, its
optional replay endpoint, the namespace its blocks live in, its block size. A poller thread
(``start()``) reads every replica's PUB endpoint, or bytes are handed to ``ingest()``. The
poller connects to an engine that binds its endpoint, or binds the endpoint of a replica with
``bind`` for an engine that connects (vLLM connects to a plain host address); ``start()``
returns once its first sockets are bound or connected, so an engine started after it loses no
batch. Each
message's sequence number is checked here; its events are applied by ``index_writer`` (blocks
keyed by prefixcache's own digests, namespaces, the rules for what is indexed) through
``deferral`` (events waiting, in order, for a shared index that cannot answer now); missed
batches are asked of the replica's replay endpoint by ``replay_client``. The poller thread only
reads the sockets: each replica's messages are applied in order by one of ``ingest_workers``
worker threads at a time, which lets the lock go while it waits on the network (a replay
endpoint, a read of a shared index's engine map), so a slow endpoint or a hung Redis holds up
that replica alone, and routes, which take the lock to read unplaced blocks, never wait on it;
events waiting for the shared index are retried on the replica's worker too. A replay is bounded
too: it ends once the batches missed are in,
after ``replay_deadline`` seconds, or after ``max_replay_frames`` answer frames (an unfilled gap,
below).

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
  subscriber had seen them stored (counted as recalled);
- a number at or below the last one: the same batch again (same number and bytes), or one
  stamped before the newest applied (it came after newer ones, its gap handled already), is
  skipped and counted as late; otherwise the publisher restarted: the replica is cleared and
  counted as a reset, then the new stream's batches before this one count as a gap (above);
- ``AllBlocksCleared`` clears the replica.
- ``recovered(name)``, called when the replica answers again after being down: cleared
  unless its replay endpoint still has the last batch applied (``restart_check``).

A message that does not decode is counted and logged; its sequence number still counts (the
next message is no gap), nothing else changes. A message with a frame over ``max_message_bytes``
never arrives: ZMQ (``ZMQ_MAXMSGSIZE``) drops the connection instead of allocating it, then
reconnects; the batches lost meanwhile are a gap (above).

Readers of the counters (metrics scrapes) never wait for the ingestion, which may be waiting on a
replay endpoint: they read a snapshot without its lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import zmq

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import (
    ConfigError,
    FleetCapacityError,
    InvalidArgumentError,
    WireFormatError,
)
from prefixcache.fleet.events.deferral import DeferringApplier
from prefixcache.fleet.events.engine_keys import EngineHasher
from prefixcache.fleet.events.inbox import ReplicaInboxes
from prefixcache.fleet.events.index_writer import EventApplier
from prefixcache.fleet.events.ingest import IngestCounts
from prefixcache.fleet.events.replay_client import (
    DEFAULT_MAX_REPLAY_FRAMES,
    DEFAULT_REPLAY_DEADLINE_S,
    fetch_batches,
)
from prefixcache.fleet.events.replica_stream import (
    ReplicaCounters,
    ReplicaEndpoint,
    ReplicaStream,
    StreamView,
    engine_key,
)
from prefixcache.fleet.events.restart_check import same_engine, stream_mark
from prefixcache.fleet.events.tenant_tally import TenantBlocks
from prefixcache.fleet.events.unplaced_lookup import UnplacedLookup
from prefixcache.fleet.events.wire import BatchDecoder, decode_seq, encode_seq
from prefixcache.fleet.index.interface import AppliedBatch, FleetIndex, SharedEngineMap
from prefixcache.fleet.replica_spec import pinned_adapter_versions

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class _ReplicaGone(Exception):
    """The replica was removed while its batch waited on the replay endpoint."""


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int of at least {minimum}, got {value!r}")
    return value


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
        replay_deadline: float = DEFAULT_REPLAY_DEADLINE_S,
        max_replay_frames: int = DEFAULT_MAX_REPLAY_FRAMES,
        ingest_workers: int = 4,
        max_deferred_events: int = 100_000,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.max_message_bytes = _int_at_least("max_message_bytes", max_message_bytes, 1)
        if not 0 < replay_deadline < float("inf"):
            raise ConfigError(f"replay_deadline must be positive, got {replay_deadline!r}")
        self.replay_deadline = replay_deadline
        self.max_replay_frames = _int_at_least("max_replay_frames", max_replay_frames, 2)
        self.ingest_workers = _int_at_least("ingest_workers", ingest_workers, 1)
        self.index = index
        self.max_replicas = max_replicas
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_tokens_per_event = max_tokens_per_event
        self.replay_timeout = replay_timeout
        # what the poller reads, applied on workers (a replay or a read of the shared index
        # lets the lock go there); a remote index sends what they wrote behind them
        self._send = getattr(index, "send_queued", None) or getattr(index, "flush", None)
        self._inbox = ReplicaInboxes(self.ingest_workers, self._on_message, self._send)
        self.max_deferred_events = max_deferred_events
        self._ctx = context or zmq.Context.instance()
        self._decoder = BatchDecoder()
        self._lock = threading.RLock()
        self._replicas: dict[str, ReplicaStream] = {}
        self._engine_map = index if isinstance(index, SharedEngineMap) else None
        self._events = EventApplier(
            index,
            self._engine_map,
            max_blocks_per_replica=max_blocks_per_replica,
            max_tokens_per_event=max_tokens_per_event,
        )
        self._events.unlocked = self._unlocked  # around its reads of the shared engine map
        self._batches = DeferringApplier(self._events, max_deferred_events)
        # what a router asks of blocks stored under parents never seen (Router(held=...))
        self.unplaced = UnplacedLookup(self._replicas, self._lock, self._events)
        if self._engine_map is not None:
            self._engine_map.attach_engine_source(self._engine_entries)
        self._stop = threading.Event()
        self._sockets_up = threading.Event()  # the poller's first sockets are bound / connected
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
        engine = None if ep.engine_hash is None else EngineHasher(ep.engine_hash, ep.block_size)
        with self._lock:
            if ep.name in self._replicas:
                raise InvalidArgumentError(f"replica {ep.name!r} is already followed")
            if len(self._replicas) >= self.max_replicas:
                raise FleetCapacityError(
                    f"already following {self.max_replicas} replicas (max_replicas)"
                )
            self._replicas[ep.name] = ReplicaStream(ep, hasher, engine=engine)
            self._pin_versions()

    def remove_replica(self, name: str) -> None:
        """Stop following ``name`` and drop it from the index."""
        with self._lock:
            if self._replicas.pop(name, None) is None:
                raise InvalidArgumentError(f"replica {name!r} is not followed")
            self._pin_versions()
            self.index.drop_replica(name)

    def _pin_versions(self) -> None:
        """Blocks of replicas serving an adapter without pinning its version (KV events name an
        adapter, never its version) take the version the followed replicas pin."""
        replicas = self._replicas.values()
        self._events.versions = pinned_adapter_versions(r.ep.namespace for r in replicas)

    def counters(self) -> dict[str, ReplicaCounters]:
        """Per-replica counters, a snapshot (taken without waiting for the ingestion)."""
        replicas = sorted(self._replicas.items())  # a copy made in one step
        return {name: rep.counters() for name, rep in replicas}

    def ingest_counts(self) -> dict[str, IngestCounts]:
        """The counters in the service's terms (``prefixcache.fleet.events.ingest.IngestStats``); a
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
                blocks_unplaced=rep.counts.unplaced,
                blocks_placed_late=rep.counts.placed_late,
                late_batches=rep.counts.late,
            )
            for name, rep in sorted(self._replicas.items())  # a copy made in one step
        }

    def stream_view(self, name: str) -> StreamView | None:
        """What the attach probe reads of replica ``name``: its counters, why its last event
        was skipped, and the engine hash announced for each digest it holds (None: not
        followed)."""
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None:
                return None
            keys = {entry[0]: h for h, entry in rep.blocks.items()}
            return StreamView(rep.counters(), rep.last_problem, keys)

    def recovered(self, name: str) -> bool:
        """Replica ``name`` answers again after being down: False when its engine still runs
        the stream applied here (``restart_check``), else True, the replica cleared (its blocks
        dropped from the index, its stream started over), also when it cannot be told (no
        replay endpoint, no batch applied yet) or the replica is not followed. The replay
        endpoint is asked without the lock held; batches applied meanwhile decide instead."""
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None:
                return True
            mark = stream_mark(rep)
        kept = same_engine(
            self._ctx,
            mark,
            timeout_s=self.replay_timeout,
            deadline_s=self.replay_deadline,
            max_message_bytes=self.max_message_bytes,
        )
        if kept:
            return False
        with self._lock:
            if self._replicas.get(name) is not rep or stream_mark(rep) != mark:
                return True  # batches came meanwhile: the sequence rules judged them
            rep.counts.resets += 1
            self._batches.restart(rep)
            rep.recent.clear()  # the new stream's numbers and stamps
            rep.newest_ts = None
            rep.last_seq = -1
        log.info(
            "replica %s restarted (its replay endpoint %s batch %d); clearing",
            name,
            "no longer has" if mark.last_seq >= 0 and mark.replay_endpoint else "cannot show",
            mark.last_seq,
        )
        return True

    def catch_up(self, name: str) -> int:
        """Ask replica ``name``'s replay endpoint for every batch after the last one applied
        here and queue them, in order, as if they had come on the stream; the number queued
        (0 without a replay endpoint, or when it has none or does not answer). For a stream
        that went quiet after batches the SUB socket never saw: a PUB socket drops what it
        publishes before a subscriber's connection is up (a replica restarted on the same
        ports answers HTTP before the subscriber's reconnect comes round), and without a later
        batch no gap shows. Batches applied meanwhile are skipped as late."""
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None or rep.ep.replay_endpoint is None:
                return 0
            endpoint, start, topic = rep.ep.replay_endpoint, rep.last_seq + 1, rep.ep.topic
        got = fetch_batches(
            self._ctx,
            endpoint,
            start,
            None,
            timeout_s=self.replay_timeout,
            replica=name,
            max_message_bytes=self.max_message_bytes,
            deadline_s=self.replay_deadline,
            max_frames=self.max_replay_frames,
        )
        for seq, payload in got or ():
            self._inbox.put(name, [topic.encode("utf-8"), encode_seq(seq), payload])
        if got:
            log.info("replica %s: caught up on batches %d..%d", name, got[0][0], got[-1][0])
        return len(got or ())

    def tenant_counts(self) -> dict[str, dict[str, TenantBlocks]]:
        """Replica -> tenant -> its GPU blocks there and evictions (own, by others), as the
        replica's events show them (``tenant_tally``)."""
        with self._lock:
            return {name: rep.tenants.snapshot() for name, rep in sorted(self._replicas.items())}

    def tenant_gpu_blocks(self, tenant: str) -> dict[str, int]:
        """Replica -> the tenant's GPU blocks there (read per route: no lock, a dict read per
        replica)."""
        return {name: rep.tenants.gpu_blocks(tenant) for name, rep in list(self._replicas.items())}

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

    def _ingest(self, rep: ReplicaStream, seq: int, payload: bytes) -> int:
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
            known = self._last_applied(rep)
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
                self._batches.restart(rep)
                known = None
            elif known is not None:
                rep.last_seq = min(known.seq, seq - 1)
                self._events.adopt(rep)  # what the index holds of it, known here at once
        elif seq <= rep.last_seq and rep.is_stale(seq, ts, payload):
            rep.counts.late += 1  # applied already (a duplicate), or lost (its gap handled)
            log.info("replica %s: batch %d came again or late; skipped", rep.ep.name, seq)
            return 0
        elif seq <= rep.last_seq:
            rep.counts.resets += 1
            log.info("replica %s: sequence went back to %d; clearing", rep.ep.name, seq)
            self._batches.restart(rep)
            rep.recent.clear()  # the new stream's numbers and stamps
            rep.newest_ts = None
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
                self._batches.restart(rep)
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
                self._batches.restart(rep)
            else:
                rep.counts.replays += 1
                for s, p in missed:
                    try:
                        got = self._decoder.decode(p)
                        rep.note_batch(s, got.ts, p)
                        self._batches.apply(rep, got.events)
                    except WireFormatError as exc:
                        rep.counts.malformed += 1
                        log.warning(
                            "replica %s: malformed replayed batch %d: %s", rep.ep.name, s, exc
                        )
                    applied += 1
        rep.seen = True
        rep.last_seq = seq
        rep.note_batch(seq, ts, payload)
        if events is not None:
            self._batches.apply(rep, events)
            applied += 1
        if self._engine_map is not None and ts is not None and not rep.deferred:
            self._engine_map.note_applied(rep.ep.name, seq, ts)
        return applied

    def _new_stream(
        self, rep: ReplicaStream, known: AppliedBatch, seq: int, ts: float | None
    ) -> bool:
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

    def _applied_since(self, rep: ReplicaStream, seq: int) -> bool:
        """Whether another router applied the batches before ``seq`` meanwhile (its note of
        them may have lagged the first read); also when the index cannot say now (the note was
        there a moment ago): a clear sent later would wipe what other routers hold."""
        again = self._last_applied(rep)
        return again is None or again.seq >= seq - 1

    def _engine_entries(self, name: str) -> list[tuple[bytes, bytes, int]]:
        """(engine key, digest, position) of each block ``name`` holds, as followed here: what
        a shared index writes back after losing its engine map. Safe from another thread."""
        rep = self._replicas.get(name)
        if rep is None:
            return []
        blocks = rep.blocks.copy()  # one step under the GIL: the ingestion may be running
        return [(engine_key(h), entry[0], entry[1]) for h, entry in blocks.items()]

    def _replay(self, rep: ReplicaStream, start: int, end: int) -> list[tuple[int, bytes]] | None:
        """Batches ``start .. end-1`` from the replica's replay endpoint, or None when it has
        no replay endpoint or cannot provide them all."""
        if rep.ep.replay_endpoint is None:
            return None
        with self._unlocked(rep):
            return fetch_batches(
                self._ctx,
                rep.ep.replay_endpoint,
                start,
                end,
                timeout_s=self.replay_timeout,
                replica=rep.ep.name,
                max_message_bytes=self.max_message_bytes,
                deadline_s=self.replay_deadline,
                max_frames=self.max_replay_frames,
            )

    def _last_applied(self, rep: ReplicaStream) -> AppliedBatch | None:
        """The last batch of the replica's stream the shared index names (a Redis read)."""
        assert self._engine_map is not None
        with self._unlocked(rep):
            return self._engine_map.last_applied(rep.ep.name)

    @contextlib.contextmanager
    def _unlocked(self, rep: ReplicaStream) -> Iterator[None]:
        """Around a network call made while applying ``rep``'s batch: on a worker, the lock is
        let go meanwhile (held once there; the replica's batches stay in order, one worker at a
        time), so that routes and the other replicas never wait on it; _ReplicaGone when the
        replica was removed meanwhile. Elsewhere (``ingest()``) the lock stays held."""
        if not self._inbox.on_worker:
            yield
            return
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
        if self._replicas.get(rep.ep.name) is not rep:
            raise _ReplicaGone(rep.ep.name)

    # ---- the poller thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the poller thread (subscribes to every replica with an endpoint); returns once
        its sockets are bound or connected."""
        if self._thread is not None:
            raise ConfigError("the subscriber is already running")
        self._stop.clear()
        self._sockets_up.clear()
        self._inbox.start()
        self._thread = threading.Thread(target=self._run, name="kv-subscriber", daemon=True)
        self._thread.start()
        self._sockets_up.wait(5.0)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the poller thread and close its sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._inbox.stop()

    def __enter__(self) -> KVEventSubscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        poller = zmq.Poller()
        sockets: dict[str, zmq.Socket[Any]] = {}
        monitors: dict[str, zmq.Socket[Any]] = {}  # each SUB socket's disconnection events
        names: dict[Any, str] = {}
        refused: dict[str, str | None] = {}  # replica -> the endpoint ZMQ would not connect to
        flush = self._send

        def close(n: str) -> None:
            sock, mon = sockets.pop(n), monitors.pop(n, None)
            for s in (sock, mon):
                if s is not None:
                    poller.unregister(s)
                    del names[s]
            if mon is not None:
                sock.disable_monitor()
                mon.close(linger=0)
            sock.close(linger=0)

        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = {n: r.ep for n, r in self._replicas.items() if r.ep.endpoint}
                for n in [n for n in sockets if n not in wanted]:
                    close(n)
                for n, ep in wanted.items():
                    if n not in sockets and refused.get(n) != ep.endpoint:
                        sock = self._ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                        sock.setsockopt(zmq.SUBSCRIBE, ep.topic.encode("utf-8"))
                        assert ep.endpoint is not None
                        try:
                            if ep.bind:
                                sock.bind(ep.endpoint)
                            else:
                                sock.connect(ep.endpoint)
                        except zmq.ZMQError as exc:  # one bad endpoint must not stop the others
                            sock.close(linger=0)
                            if ep.bind and exc.errno == zmq.EADDRINUSE:
                                # a socket closed a moment ago may hold it still: next round
                                if refused.get(n) != "in use":
                                    log.warning("replica %s: %s is in use", n, ep.endpoint)
                                    refused[n] = "in use"
                                continue
                            refused[n] = ep.endpoint
                            with self._lock:
                                if n in self._replicas:
                                    self._replicas[n].counts.malformed += 1
                            log.error(
                                "replica %s: cannot %s %s: %s",
                                n,
                                "bind" if ep.bind else "connect to",
                                ep.endpoint,
                                exc,
                            )
                            continue
                        refused.pop(n, None)
                        sockets[n] = sock
                        names[sock] = n
                        poller.register(sock, zmq.POLLIN)
                        if not ep.bind:
                            # a bound socket keeps accepting, and its engines reconnect
                            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                            monitors[n] = mon
                            names[mon] = n
                            poller.register(mon, zmq.POLLIN)
                self._sockets_up.set()
                if sockets:
                    ready = poller.poll(50)
                else:  # zmq's poll of no socket returns at once: the loop would spin
                    self._stop.wait(0.05)
                    ready = []
                for sock, _ in ready:
                    name = names.get(sock)
                    if name is None:  # closed in this round
                        continue
                    if sock is monitors.get(name):
                        # ZMQ does not reconnect after a message over max_message_bytes (a
                        # protocol error): a fresh socket connects in the next round
                        log.warning("replica %s: connection dropped; reconnecting", name)
                        close(name)
                        continue
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._inbox.put(name, frames)
                with self._lock:  # events waiting for the shared index: their worker retries
                    waiting = [name for name, rep in self._replicas.items() if rep.deferred]
                for name in waiting:
                    self._inbox.nudge(name)
                if ready and flush is not None:  # a remote index: send what the round wrote
                    try:
                        flush()
                    except Exception:  # the index counts its own failures; keep ingesting
                        log.exception("flushing the fleet index failed")
        finally:
            for n in list(sockets):
                close(n)

    def _on_message(self, name: str, frames: list[bytes]) -> None:
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None:
                return
            if not frames:  # a nudge: apply the events that wait for the shared index
                with contextlib.suppress(_ReplicaGone):
                    self._batches.drain(rep)
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
            except _ReplicaGone:
                return
            except Exception:  # an index failure must not stop the poller
                rep.counts.malformed += 1
                log.exception("replica %s: batch %d not applied", name, seq)
