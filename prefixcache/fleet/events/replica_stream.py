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
from prefixcache.fleet.events.wire import BlockHash


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

    def counters(self) -> ReplicaCounters:
        """The stream's counters now."""
        return ReplicaCounters(**vars(self.counts), last_seq=self.last_seq)


def engine_key(h: BlockHash) -> bytes:
    """An engine block hash as a shared engine map's key: ``i<decimal>``, ``b<bytes>``, or for
    bytes longer than 64 ``h`` and their 128-bit xxh3 digest (keys stay short)."""
    if isinstance(h, int):
        return b"i%d" % h
    raw = bytes(h)
    return b"b" + raw if len(raw) <= 64 else b"h" + xxhash.xxh3_128_digest(raw)
