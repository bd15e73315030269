"""Which connection goes when one opens (``ConnectionShares``), without a server: connections
stand in with whether they wait on their client, the clock is the test's."""

from __future__ import annotations

from prefixcache.fleet.service.guards.connection_budget import ConnectionBudget
from prefixcache.fleet.service.guards.connection_shares import ConnectionShares


class Conn:
    def __init__(self, name: str, waiting: bool = True) -> None:
        self.name = name
        self.waiting = waiting

    def waiting_on_client(self) -> bool:
        return self.waiting

    def __repr__(self) -> str:
        return self.name


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every connection opens or is answered a second after the last
        return self.now


def _shares(max_connections: int | None = 10, per_address: int | None = 5) -> ConnectionShares:
    open_max = None if max_connections is None else max_connections + 2
    budget = ConnectionBudget(max_connections, open_max, per_address, None)
    return ConnectionShares(budget, Clock())


def test_past_the_budget_the_address_holding_most_loses_its_connection_waiting_longest() -> None:
    shares = _shares()
    attack = [Conn(f"a{k}") for k in range(6)] + [Conn(f"b{k}") for k in range(4)]
    for k, conn in enumerate(attack):
        assert shares.opened(conn, "10.0.0.1" if k < 6 else "10.0.0.2") is None
    assert shares.held == 10
    fresh = Conn("fresh")
    assert shares.opened(fresh, "10.0.0.9") is attack[0]  # the most, waiting longest
    shares.closed(attack[0])
    health = Conn("health")
    assert shares.opened(health, "10.0.0.8") is attack[1]  # 5 and 4: still 10.0.0.1
    shares.closed(attack[1])
    assert shares.held == 10


def test_of_the_addresses_holding_most_another_than_the_new_ones_goes_first() -> None:
    shares = _shares()
    held = {"a": [Conn(f"a{k}") for k in range(3)], "b": [Conn(f"b{k}") for k in range(4)]}
    held["c"] = [Conn(f"c{k}") for k in range(3)]
    for address, conns in held.items():
        for conn in conns:
            assert shares.opened(conn, address) is None
    # a holds 4 with it, as b does (an equal share of 10 among three is 4): b loses one
    assert shares.opened(Conn("a3"), "a") is held["b"][0]


def test_past_its_share_an_address_loses_its_own_connection_waiting_longest() -> None:
    shares = _shares()
    mine = [Conn(f"m{k}") for k in range(5)]
    for conn in mine:
        assert shares.opened(conn, "a") is None
    for k in range(4):
        shares.opened(Conn(f"o{k}"), "b")
    # 9 held by two: its share is max(5, floor(5 * 0.1)) = 5, and a sixth is past it
    assert shares.opened(Conn("m5"), "a") is mine[0]


def test_a_connection_the_service_is_answering_is_never_closed() -> None:
    shares = _shares()
    busy = [Conn(f"busy{k}", waiting=False) for k in range(10)]
    for conn in busy:
        assert shares.opened(conn, "10.0.0.1") is None
    first = Conn("x1")
    assert shares.opened(first, "10.0.0.2") is None  # no other waits: it stays (503 but health)
    second = Conn("x2")
    assert shares.opened(second, "10.0.0.3") is first  # x1 waits: it goes
    shares.closed(first)
    second.waiting = False  # being answered now
    third = Conn("x3")
    assert shares.opened(third, "10.0.0.4") is None  # 12 held: within the headroom
    third.waiting = False
    past = Conn("past")
    assert shares.opened(past, "10.0.0.5") is past  # nothing to close, past the headroom


def test_an_answer_makes_a_connection_wait_anew_and_trickled_bytes_do_not() -> None:
    shares = _shares()
    conns = [Conn(f"c{k}") for k in range(10)]
    for conn in conns:
        shares.opened(conn, "10.0.0.1")
    shares.answered(conns[0])  # a keep-alive connection answered a moment ago
    assert shares.opened(Conn("new"), "10.0.0.2") is conns[1]


def test_an_address_share_tightens_as_the_budget_fills() -> None:
    shares = _shares(max_connections=100, per_address=50)
    assert shares.share() == 100  # no one yet: all of it, an equal share for one address
    mine = [Conn(f"m{k}") for k in range(40)]
    for conn in mine:
        assert shares.opened(conn, "10.0.0.1") is None
    others = [Conn(f"o{k}") for k in range(20)]
    for k, conn in enumerate(others):
        shares.opened(conn, f"10.0.1.{k}")
    # 60 held by 21 addresses: max(ceil(100 / 21), floor(50 * 0.4)) = 20
    assert shares.share() == 20
    new = Conn("m40")
    assert shares.opened(new, "10.0.0.1") is mine[0]  # past its share: its own goes
    shares.closed(mine[0])
    for conn in mine[1:30]:
        conn.waiting = False
    for conn in mine[30:]:
        conn.waiting = False
    busy_new = Conn("m41")
    assert shares.opened(busy_new, "10.0.0.1") is new  # its only waiting one, the newer
    shares.closed(new)
    last = Conn("m42")
    assert shares.opened(last, "10.0.0.1") is busy_new
    shares.closed(busy_new)
    busy_new2 = Conn("m43")
    last.waiting = False
    # none of its others waits, and the service is not full: it stays (its others are being
    # answered, not held)
    assert shares.opened(busy_new2, "10.0.0.1") is None


def test_connections_closed_for_room_count_no_more_and_are_not_chosen_twice() -> None:
    shares = _shares()
    conns = [Conn(f"c{k}") for k in range(10)]
    for conn in conns:
        shares.opened(conn, "10.0.0.1")
    assert not shares.over_budget
    assert shares.opened(Conn("n1"), "10.0.0.2") is conns[0]
    assert shares.held == 11 and not shares.over_budget  # c0 is on its way out
    assert shares.opened(Conn("n2"), "10.0.0.3") is conns[1]  # not c0 again
    shares.closed(conns[0])
    shares.closed(conns[1])
    for conn in conns[2:]:
        conn.waiting = False
    last = Conn("n3")
    assert shares.opened(last, "10.0.0.4") is not None  # n1 or n2, both waiting
    assert shares.held == 11


def test_without_a_connection_limit_nothing_is_closed() -> None:
    shares = _shares(max_connections=None, per_address=None)
    for k in range(50):
        assert shares.opened(Conn(f"c{k}"), "10.0.0.1") is None
    assert shares.share() is None
