"""Whether each replica takes routes: marked down (a failed request, a failed health probe) until
a time, or up.

A replica marked down takes no routes until its time passes or it is marked up; lookups still
score it. ``HealthMarks`` is the router's record of it, kept under the router's lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class ReplicaHealth(NamedTuple):
    """Whether a replica takes routes now."""

    name: str
    up: bool
    down_for_s: float  # seconds until it takes routes again by itself (0 when up)
    reason: str  # why it was marked down ("" when up)
    marked_down: int  # times it went down so far


class DownMark(NamedTuple):
    """Why a replica takes no routes, and until when (on the router's clock)."""

    until: float
    reason: str


class HealthMarks:
    """The replicas marked down and how often each went down. Not thread-safe: the router calls
    it with its lock held."""

    def __init__(self) -> None:
        self.down: dict[str, DownMark] = {}  # empty while every replica is up
        self._marked_down: dict[str, int] = {}

    def mark_down(self, name: str, until: float, reason: str, now: float) -> None:
        """Replica ``name`` takes no routes until ``until``; counted when it goes down, not
        while it stays down."""
        if not self.is_down(name, now):
            self._marked_down[name] = self._marked_down.get(name, 0) + 1
        self.down[name] = DownMark(until, reason)

    def mark_up(self, name: str) -> None:
        """Replica ``name`` takes routes again."""
        self.down.pop(name, None)

    def forget(self, name: str) -> None:
        """Replica ``name`` left the fleet."""
        self.down.pop(name, None)
        self._marked_down.pop(name, None)

    def is_down(self, name: str, now: float) -> bool:
        """Whether ``name`` is marked down at ``now`` (a mark whose time is up is dropped)."""
        mark = self.down.get(name)
        if mark is None:
            return False
        if mark.until <= now:  # its time is up: it takes routes again
            del self.down[name]
            return False
        return True

    def back_at(self, names: Iterable[str]) -> float:
        """The earliest time one of ``names`` (some of them marked down) takes routes again."""
        down = self.down
        return min(down[name].until for name in names if name in down)

    def health(self, names: Iterable[str], now: float) -> list[ReplicaHealth]:
        """Up or down, for each of ``names`` in order."""
        out = []
        for name in names:
            mark = self.down.get(name)
            up = mark is None or mark.until <= now
            out.append(
                ReplicaHealth(
                    name,
                    up,
                    0.0 if up or mark is None else mark.until - now,
                    "" if up or mark is None else mark.reason,
                    self._marked_down.get(name, 0),
                )
            )
        return out
