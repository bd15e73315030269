"""Apply a replica's event batches in stream order while the shared index may not answer.

A replica the subscriber joined midway needs the shared engine map (a Redis index) to map the
removals and continuations of blocks stored before it came. While the index cannot be asked
(Redis away), an event that needs such a lookup waits, and every later event of the replica with
it, in stream order, until the index answers; past ``max_deferred_events`` waiting events the
replica is cleared instead (its entries may be stale), and the waiting events go with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prefixcache.fleet.events.index_writer import EventApplier
from prefixcache.fleet.events.replica_stream import ReplicaStream

log = logging.getLogger(__name__)


class DeferringApplier:
    """Applies batches through ``events``, holding back in order what the index cannot answer
    now. The caller serialises the calls (the subscriber's lock)."""

    def __init__(self, events: EventApplier, max_deferred_events: int) -> None:
        self.events = events
        self.max_deferred_events = max_deferred_events

    def apply(self, rep: ReplicaStream, events: Sequence[Any]) -> None:
        """Apply one batch (counted), after the events still waiting."""
        rep.counts.batches += 1
        if rep.deferred:  # in stream order: after the events still waiting
            rep.deferred.append(list(events))
            self.drain(rep)
        else:
            k = self.events.apply(rep, events)
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
            self.restart(rep)

    def drain(self, rep: ReplicaStream) -> None:
        """Apply the waiting events, in order, as far as the shared index answers."""
        while rep.deferred:
            events = rep.deferred.pop(0)
            k = self.events.apply(rep, events)
            if k is not None:
                rep.deferred.insert(0, events[k:])
                return

    def restart(self, rep: ReplicaStream) -> None:
        """Clear the replica for a stream that restarted or lost batches: the events still
        waiting came before, and go too."""
        rep.deferred = []
        self.events.clear(rep)
