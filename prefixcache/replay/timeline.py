"""timeline.csv rows, sampled evenly without knowing the length of the replay in advance.

Rows are taken every ``every`` ticks (requests or steps); whenever twice the target count is
reached, every other row is dropped and the interval doubles, so a replay of any length ends with
between ``target`` and ``2 * target`` evenly spaced rows, plus the final state.
"""

from __future__ import annotations


class Timeline:
    def __init__(self, target: int = 1000) -> None:
        self.target = target
        self.every = 1
        self.rows: list[tuple] = []
        self._last_tick = -1

    def due(self, tick: int) -> bool:
        return tick % self.every == 0

    def add(self, tick: int, row: tuple) -> None:
        self._last_tick = tick
        self.rows.append(row)
        if len(self.rows) >= 2 * self.target:
            self.rows = self.rows[::2]
            self.every *= 2
            if self.rows[-1] is not row:
                self._last_tick = -1

    def finish(self, tick: int, row: tuple) -> None:
        """The state at the end of the replay, always the last row."""
        if tick == self._last_tick and self.rows:
            self.rows[-1] = row
        else:
            self.rows.append(row)
        self._last_tick = tick
