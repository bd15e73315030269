"""One replica's event stream as a subscriber follows it: where the replica publishes
(``ReplicaEndpoint``), what its stream has brought (``ReplicaCounters``), and the state kept for
it (``ReplicaStream``): the map engine hash -> (digest, position, media) of the blocks it holds,
the last sequence number, whether the subscriber joined the stream midway, and the events waiting
for a shared index that cannot answer now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.fleet.events.engine_keys import EngineHasher, EngineHashSpec
from prefixcache.fleet.events.tenant_tally import TenantTally
from prefixcache.fleet.events.unplaced import RecentRoutes, UnplacedBlocks
from prefixcache.fleet.events.wire import BlockHash


@dataclass(frozen=True)
class ReplicaEndpoint:
    """Where one replica publishes, and how to read its blocks."""

    name: str
    endpoint: str | None = None  # its PUB endpoint (connected to); None: fed through ingest()
    replay_endpoint: str | None = None  # ROUTER endpoint for missed batches
    namespace: Namespace = DEFAULT_NAMESPACE  # model (and salt) of its blocks
    block_size: int = 16
    topic: str = ""
    hash_algo: str = "xxh3_128"
    engine_hash: EngineHashSpec | None = None  # how its engine hashes blocks, when reproducible
    kv_store: str | None = None  # the shared K/V store its STORE-medium events speak of
    # bind ``endpoint`` for the engine to connect to (vLLM connects to a plain host address)
    bind: bool = False


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
    unplaced: int  # blocks stored under a parent never seen, kept until placed
    placed_late: int  # unplaced blocks placed since (a later event, a lookup, a route)
    late: int  # batches that came again (duplicates) or after newer ones, skipped
    last_seq: int  # -1 before the first batch


class StreamView(NamedTuple):
    """One replica's stream as the attach probe reads it (``KVEventSubscriber.stream_view``)."""

    counters: ReplicaCounters
    last_problem: str  # why the last event that did not fit was skipped ("" if none was)
    announced: dict[bytes, BlockHash]  # digest -> the engine hash its event named


@dataclass
class StreamCounts:
    """The running counters of one replica's stream (``ReplicaCounters`` without ``last_seq``)."""

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
    unplaced: int = 0
    placed_late: int = 0
    late: int = 0


@dataclass
class ReplicaStream:
    """What a subscriber keeps of one followed replica."""

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
    counts: StreamCounts = field(default_factory=StreamCounts)
    unplaced: UnplacedBlocks = field(default_factory=UnplacedBlocks)  # parent never seen
    engine: EngineHasher | None = None  # its engine's block hashes, when reproducible
    routes: RecentRoutes = field(default_factory=RecentRoutes)  # prompts routed to it
    # digests indexed for it without an engine hash (placed through a route): dropped from the
    # index at the first removal of a hash never seen (it may be one of them)
    hashless: set[bytes] = field(default_factory=set)
    recent: dict[int, int] = field(default_factory=dict)  # seq -> payload's hash, latest ones
    newest_ts: float | None = None  # of the batches applied since the last restart
    tenants: TenantTally = field(default_factory=TenantTally)  # GPU blocks per service tenant
    last_problem: str = ""  # why the last event that did not fit was skipped

    def note_batch(self, seq: int, ts: float | None, payload: bytes) -> None:
        """Batch ``seq`` (stamped ``ts``, sent as ``payload``) was applied."""
        recent = self.recent
        recent[seq] = xxhash.xxh3_64_intdigest(payload)
        if len(recent) > _RECENT_BATCHES:
            del recent[next(iter(recent))]
        if ts is not None and (self.newest_ts is None or ts > self.newest_ts):
            self.newest_ts = ts

    def is_stale(self, seq: int, ts: float | None, payload: bytes) -> bool:
        """Whether batch ``seq`` (at or below the last number) is of the current stream: the
        same batch again, or one stamped before the newest applied (it came after newer ones;
        its gap was handled), not a restarted publisher's (stamped after it)."""
        if ts is None:
            return False
        if seq in self.recent:
            return self.recent[seq] == xxhash.xxh3_64_intdigest(payload)
        return self.newest_ts is not None and ts < self.newest_ts

    def counters(self) -> ReplicaCounters:
        """The stream's counters now."""
        return ReplicaCounters(**vars(self.counts), last_seq=self.last_seq)


_RECENT_BATCHES = 1024


def engine_key(h: BlockHash) -> bytes:
    """An engine block hash as a shared engine map's key: ``i<decimal>``, ``b<bytes>``, or for
    bytes longer than 64 ``h`` and their 128-bit xxh3 digest (keys stay short)."""
    if isinstance(h, int):
        return b"i%d" % h
    raw = bytes(h)
    return b"b" + raw if len(raw) <= 64 else b"h" + xxhash.xxh3_128_digest(raw)


def block_hash_of_key(key: bytes) -> BlockHash | None:
    """The engine block hash a shared engine map's key names (``engine_key`` reversed); None
    for the digest form of a long hash, or a key this release does not write."""
    if key[:1] == b"b":
        return bytes(key[1:])
    if key[:1] == b"i":
        try:
            return int(key[1:])
        except ValueError:
            return None
    return None
