"""A subscriber with no event endpoint to read (every replica fed through ``ingest()``, or none)
waits between rounds instead of spinning: ZMQ's poll returns at once when it has no socket, and a
poller thread spinning on it holds the GIL, which the service's event loop then waits for on
every request (about 10 ms a request through the proxy)."""

from __future__ import annotations

import threading

from prefixcache.fleet.events.replica_stream import ReplicaEndpoint
from prefixcache.fleet.events.subscriber import KVEventSubscriber
from prefixcache.fleet.index.memory import MemoryFleetIndex


class _CountingEvent(threading.Event):
    """An event that counts how often it is set (once a poller round)."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_a_subscriber_with_nothing_to_poll_does_not_spin() -> None:
    sub = KVEventSubscriber(MemoryFleetIndex(), [ReplicaEndpoint("fed-by-hand")])
    rounds = _CountingEvent()
    sub._sockets_up = rounds  # counts the poller's rounds
    sub.start()
    try:
        threading.Event().wait(0.5)  # half a second of an idle subscriber
    finally:
        sub.stop()
    # a round waits 50 ms for sockets that have nothing: about 10 rounds, not thousands
    assert 1 <= rounds.sets <= 50, rounds.sets
