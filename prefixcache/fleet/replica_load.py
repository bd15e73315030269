"""The in-flight requests of a fleet and the load they put on each replica: how many requests
were routed to it and not yet released, and the prompt tokens of those it has to compute (the
ones it did not cache when they were routed: its prefill work).

A request routed with a deadline (the router's ``in_flight_timeout``) stops counting once the
deadline passes without a release, e.g. because its client died; it is counted as expired. A
replica removed and added again starts afresh: releases of requests routed to it before do not
lower its new load. ``InFlightLoads`` is the router's record of it, kept under the router's lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple


class ReplicaLoad(NamedTuple):
    """In-flight requests on one replica and their prompt tokens it has to compute (those it
    did not cache when they were routed: its prefill work)."""

    name: str
    in_flight: int
    in_flight_tokens: int


class Released(NamedTuple):
    """The in-flight request that ``release`` ended."""

    request_id: str
    replica: str
    prompt_tokens: int


class _InFlight(NamedTuple):
    replica: str
    tokens: int  # the prompt's
    work: int  # of those, the ones the replica did not cache when routed (its load)
    generation: int  # of the replica when routed: a removed and re-added replica starts afresh
    deadline: float  # on the router's clock: the load ends then if nobody released it


class InFlightLoads:
    """Requests in flight by id, and the load per replica. Not thread-safe: the router calls it
    with its lock held."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # name -> [in_flight, in_flight_tokens], read by the router's scoring
        self.load: dict[str, list[int]] = {}
        self.requests: dict[str, _InFlight] = {}  # request id -> its route
        self.expired = 0  # routes whose load ended by their deadline, never released
        self._generation: dict[str, int] = {}
        self._next_generation = 0
        self._deadlines: deque[tuple[str, _InFlight]] = deque()  # in route order (and deadline)

    def add_replica(self, name: str) -> None:
        """Replica ``name`` joined the fleet, with no load."""
        self.load[name] = [0, 0]
        self._generation[name] = self._next_generation
        self._next_generation += 1

    def remove_replica(self, name: str) -> None:
        """Replica ``name`` left the fleet; its in-flight requests can still be released."""
        del self.load[name]
        del self._generation[name]

    def loads(self, names: Iterable[str]) -> list[ReplicaLoad]:
        """The load of each of ``names``, in order."""
        load = self.load
        return [ReplicaLoad(name, load[name][0], load[name][1]) for name in names]

    def charge(
        self, request_id: str, replica: str, tokens: int, work: int, timeout: float | None
    ) -> None:
        """Count a request routed to ``replica`` (``tokens`` prompt tokens, ``work`` of them to
        compute) until it is released or, with a ``timeout``, that many seconds pass."""
        load = self.load[replica]
        load[0] += 1
        load[1] += work
        deadline = math.inf if timeout is None else self._clock() + timeout
        entry = _InFlight(replica, tokens, work, self._generation[replica], deadline)
        self.requests[request_id] = entry
        if timeout is not None:
            self._deadlines.append((request_id, entry))
            if len(self._deadlines) > 2 * len(self.requests) + 1024:
                self._compact_deadlines()

    def release(self, request_id: str) -> Released | None:
        """End an in-flight request: its replica's load drops. None when it is not in flight."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return None
        self._drop_load(entry)
        return Released(request_id, entry.replica, entry.tokens)

    def expire(self) -> None:
        """End the loads whose deadline has passed."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = self._clock()
        while deadlines and deadlines[0][1].deadline <= now:
            request_id, entry = deadlines.popleft()
            if self.requests.get(request_id) is not entry:  # released (or routed anew)
                continue
            del self.requests[request_id]
            self._drop_load(entry)
            self.expired += 1

    def _compact_deadlines(self) -> None:
        """Forget the deadlines of routes released already (they would wait for their time)."""
        requests = self.requests
        self._deadlines = deque(
            (rid, entry) for rid, entry in self._deadlines if requests.get(rid) is entry
        )

    def _drop_load(self, entry: _InFlight) -> None:
        if self._generation.get(entry.replica) == entry.generation:
            load = self.load[entry.replica]
            load[0] -= 1
            load[1] -= entry.work
