"""The seam between the service and whatever feeds its index (e.g. a KV-event subscriber).

An ``IngestSource`` is started when the service starts and stopped when it stops (the app's
lifespan). ``start`` must return promptly, running its work on its own threads or tasks, and
``stop`` must return once that work has ended. A source that also counts what it ingests
implements ``IngestStats``; the service exports those counters on ``/metrics`` at every scrape,
so the source only keeps plain running totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol, runtime_checkable


class IngestCounts(NamedTuple):
    """Running totals of one replica's ingestion since the source started."""

    events: int = 0  # event batches or messages received
    blocks_stored: int = 0
    blocks_removed: int = 0
    sequence_gaps: int = 0  # jumps in the sequence numbers (each a run of lost messages)
    errors: int = 0  # failed index writes (e.g. Redis errors) and undecodable messages
    blocks_skipped: int = 0  # blocks not indexed by rule (other attention groups, nameless LoRA)
    blocks_recalled: int = 0  # stored before the router joined, mapped through the shared index
    blocks_unplaced: int = 0  # stored under a parent never seen, kept until placed
    blocks_placed_late: int = 0  # unplaced blocks placed since (a later event, a lookup, a route)
    late_batches: int = 0  # batches that came again or after newer ones, skipped


@runtime_checkable
class IngestSource(Protocol):
    """Feeds the index for the service's lifetime."""

    def start(self) -> None:
        """Begin ingesting; return promptly."""

    def stop(self) -> None:
        """Stop ingesting; return when stopped."""


@runtime_checkable
class IngestStats(Protocol):
    """A source of per-replica ingest counters."""

    def ingest_counts(self) -> Mapping[str, IngestCounts]:
        """Replica name -> its running totals (a snapshot; called at each metrics scrape)."""
