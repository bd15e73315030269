"""What a serving replay measures after its steps: peak block usage and the timeline's rows.

One tally serves one simulation or a fleet's replicas together. A single simulation takes a
row every so many of its timed steps, at its clock; a fleet counts every step any replica takes
(a step that found nothing to run included) and takes a row at the fleet's now, the earliest
clock of a busy replica, with the blocks of every replica summed.

Usage peaks only move when blocks do: physical blocks change only in a step that calls the cache
manager, and logical blocks (kept up to date by each simulator) only when a request is admitted,
writes, finishes or leaves. So the tally looks at usage after such steps (``after_event``) and
only counts the others (``after_quiet``); the fragmentation that goes with a new physical peak
is computed when one is reached.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any, Protocol

from prefixcache.manager.stats import BlockCounts
from prefixcache.replay.sim.accounting import Accountant


class TallyMember(Protocol):
    """What the tally reads of a serving simulation (``serving.Simulator``)."""

    steps: int
    clock: float
    logical: int
    tally: Any
    tally_slot: int

    @property
    def running(self) -> Sized: ...

    @property
    def waiting(self) -> Sized: ...

    def usage(self) -> tuple[int, int]: ...

    def active_blocks(self) -> int: ...

    def block_counts(self) -> BlockCounts: ...

    def evicted_blocks(self) -> int: ...


class StepTally:
    """Usage peaks and timeline rows of ``members`` (one simulator, or a fleet's replicas when
    ``fleet``), into ``acc``."""

    def __init__(self, acc: Accountant, members: Sequence[TallyMember], fleet: bool) -> None:
        self.acc = acc
        self.members = members
        self.fleet = fleet
        self.steps = 0  # a fleet's steps, every replica's together
        self.physical = [0] * len(members)  # each member's active blocks after its last step
        self.physical_sum = 0  # their sum
        for k, sim in enumerate(members):
            sim.tally = self
            sim.tally_slot = k

    def after_event(self, sim: TallyMember, timed: bool) -> None:
        """``sim`` took a step that may have changed blocks (``timed``: time passed in it)."""
        acc = self.acc
        if not self.fleet:
            if not timed:
                return  # a simulation measures its timed steps only
            physical = sim.active_blocks()
            logical = sim.logical
            if physical > acc.physical_peak or logical > acc.logical_peak:
                logical, frag = sim.usage()
                acc.note_usage(physical, logical, frag)
            self._row(sim.steps, sim.clock, False)
            return
        self.steps += 1
        slot = sim.tally_slot
        active = sim.active_blocks()
        physical = self.physical_sum + active - self.physical[slot]
        self.physical[slot] = active
        self.physical_sum = physical
        logical = 0
        for member in self.members:
            logical += member.logical
        if physical > acc.physical_peak or logical > acc.logical_peak:
            logical, frag = self._usage()
            acc.note_usage(physical, logical, frag)
        timeline = acc.timeline
        if timeline is not None and self.steps % timeline.every == 0:  # the fleet's now, if due
            self._row(self.steps, self._now(), False)

    def after_quiet(self, sim: TallyMember) -> None:
        """``sim`` took a step that only advanced its clock and its token counts."""
        timeline = self.acc.timeline
        if self.fleet:
            self.steps += 1
            if timeline is not None and self.steps % timeline.every == 0:
                self._row(self.steps, self._now(), False)
        elif timeline is not None and sim.steps % timeline.every == 0:
            self._row(sim.steps, sim.clock, False)

    def finish(self) -> None:
        """The state at the end of the replay: usage, and the timeline's last row."""
        acc = self.acc
        if not self.fleet:
            sim = self.members[0]
            logical, frag = sim.usage()
            acc.note_usage(sim.active_blocks(), logical, frag)
            self._row(sim.steps, sim.clock, True)
            return
        logical, frag = self._usage()
        acc.note_usage(self.physical_sum, logical, frag)
        self._row(self.steps, self._now(), True)

    def _usage(self) -> tuple[int, int]:
        logical = frag = 0
        for member in self.members:
            lg, fr = member.usage()
            logical += lg
            frag += fr
        return logical, frag

    def _now(self) -> float:
        """The fleet's now: the earliest clock of a busy replica (replicas step in that order,
        so it never goes back); with all idle, when the last one finished."""
        now = -1.0
        latest = 0.0
        for member in self.members:
            clock = member.clock
            if (member.running or member.waiting) and (now < 0 or clock < now):
                now = clock
            latest = max(latest, clock)
        return now if now >= 0 else latest

    def _row(self, tick: int, clock: float, final: bool) -> None:
        acc = self.acc
        timeline = acc.timeline
        if timeline is None or not (final or tick % timeline.every == 0):
            return
        free = active = cached = evicted = 0
        for member in self.members:
            counts = member.block_counts()
            free += counts.free
            active += counts.active
            cached += counts.cached
            evicted += member.evicted_blocks()
        if self.fleet:
            total = BlockCounts(free, active, cached)
        else:
            total = self.members[0].block_counts()
        acc.sample_timeline(tick, clock, total, evicted, final)
