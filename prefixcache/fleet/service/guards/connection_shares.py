"""Each client address's share of the connections the service holds (``ConnectionShares``), and
which connection is closed to make room when a new one comes.

A connection *waits on its client* while its next request is incomplete: no complete head yet
(a new connection, an idle keep-alive one, a slowloris trickling header bytes), or a head whose
body has not all arrived. It has waited since it opened or since its last answer was sent; bytes
that trickle in do not make it younger. A connection whose request the service is working on
(the whole request in, the answer not yet sent) never waits on its client and is never closed
here. When a connection opens:

- its address's **share** is ``max_requests_per_client`` while the service holds few
  connections, tightening as the budget fills, down to an equal share of ``max_connections``
  among the addresses connected once all of it is held: ``max(ceil(max_connections /
  addresses), floor(max_requests_per_client * (1 - held / max_connections)))``. An address past
  its share loses its own connection that has waited longest (when one of its others waits);
- past ``max_connections`` connections, the address holding the most loses its connection that
  has waited longest, any address but the new connection's own first when they hold as many;
  the new connection stays. When no connection waits on its client (every one is being answered),
  nothing is closed: the new connection's requests get 503 (health checks excepted) until some
  end, and past ``max_open_connections`` it is closed unanswered.

So many addresses together cannot hold the service either: a new client (a load balancer's
health check, a fresh caller) always gets a connection while any partial request is held, and it
comes at the cost of the addresses holding the most. Health and readiness (``HEALTH_PATHS``) are
never answered 503 for connection pressure.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from prefixcache.fleet.service.guards.connection_budget import ConnectionBudget

HEALTH_PATHS = frozenset(("/health", "/healthz"))  # never refused for connection pressure


class ClientConnection(Protocol):
    """What the shares ask of an open connection."""

    def waiting_on_client(self) -> bool:
        """Whether its next request is incomplete (nothing of it is being answered)."""
        ...


class ConnectionShares:
    """The open connections of one server by client address, oldest waiting first; decides
    which connection goes when one opens (see the module docstring). Used from the event loop's
    thread only."""

    def __init__(
        self, budget: ConnectionBudget, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_connections = budget.max_connections
        self.max_open_connections = budget.max_open_connections
        self.max_per_address = budget.max_requests_per_client
        self._clock = clock
        # address -> its connections, the one waiting longest first -> since when it waits
        self._by_address: dict[str, OrderedDict[ClientConnection, float]] = {}
        self._address: dict[ClientConnection, str] = {}
        self._leaving: set[ClientConnection] = set()  # closed for room, not yet gone

    @property
    def over_budget(self) -> bool:
        """Whether more than ``max_connections`` connections are open, not counting those
        closed for room and on their way out."""
        limit = self.max_connections
        return limit is not None and len(self._address) - len(self._leaving) > limit

    @property
    def held(self) -> int:
        """Connections open now."""
        return len(self._address)

    def share(self) -> int | None:
        """The connections one address may hold now (None: no limit)."""
        if self.max_connections is None:
            return None
        fair = math.ceil(self.max_connections / max(1, len(self._by_address)))
        if self.max_per_address is None:
            return fair
        free = max(0.0, 1.0 - self.held / self.max_connections)
        return max(fair, math.floor(self.max_per_address * free))

    def opened(self, conn: ClientConnection, address: str) -> ClientConnection | None:
        """``conn`` from ``address`` opened: the connection to close to make room (``conn``
        itself when there is none and it may not stay), or None. The caller closes it."""
        victim = self._choose(conn, address)
        if victim is not None:
            self._leaving.add(victim)
        return victim

    def _choose(self, conn: ClientConnection, address: str) -> ClientConnection | None:
        conns = self._by_address.setdefault(address, OrderedDict())
        conns[conn] = self._clock()
        self._address[conn] = address
        share = self.share()
        if share is None:
            return None
        if len(conns) > share:
            own = self._longest_waiting(conns, besides=conn)
            if own is not None:
                return own
        if self.max_connections is not None and self.held > self.max_connections:
            victim = self._from_the_most(besides=conn)
            if victim is not None:
                return victim
            if self.max_open_connections is not None and self.held > self.max_open_connections:
                return conn
        return None

    def answered(self, conn: ClientConnection) -> None:
        """An answer to ``conn`` was sent: it waits for its next request from now."""
        address = self._address.get(conn)
        if address is not None:
            conns = self._by_address[address]
            conns[conn] = self._clock()
            conns.move_to_end(conn)

    def closed(self, conn: ClientConnection) -> None:
        """``conn`` ended."""
        address = self._address.pop(conn, None)
        self._leaving.discard(conn)
        if address is None:
            return
        conns = self._by_address[address]
        del conns[conn]
        if not conns:
            del self._by_address[address]

    def _from_the_most(self, besides: ClientConnection) -> ClientConnection | None:
        """The connection waiting longest of the address holding the most, ties going against
        another address than ``besides``'s; None when no connection but ``besides`` waits."""
        own = self._address[besides]
        ranked = sorted(
            self._by_address.items(), key=lambda item: (len(item[1]), item[0] != own), reverse=True
        )
        for _, conns in ranked:
            victim = self._longest_waiting(conns, besides)
            if victim is not None:
                return victim
        return None

    def _longest_waiting(
        self, conns: OrderedDict[ClientConnection, float], besides: ClientConnection
    ) -> ClientConnection | None:
        """The connection of ``conns`` (oldest first) that waits on its client and has waited
        longest, ``besides`` and those already leaving left out; None when there is none."""
        leaving = self._leaving
        for conn in conns:
            if conn is not besides and conn not in leaving and conn.waiting_on_client():
                return conn
        return None
