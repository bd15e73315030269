"""Progress of a replay: serving counts completed requests; traces get a total up front."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr
from pathlib import Path
from typing import ClassVar

import pytest

from prefixcache.replay import runner
from prefixcache.replay.progress import Progress, count_lines
from prefixcache.replay.run_config import ReplayConfig

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests" / "golden" / "chat_small.yaml"
TRACE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


class Recorder(Progress):
    """A Progress that keeps every update instead of drawing."""

    made: ClassVar[list[Recorder]] = []

    def __init__(self, total: int | None, label: str, unit: str = "req") -> None:
        self.total, self.label, self.unit = total, label, unit
        self.updates: list[int] = []
        self.closed: bool | None = None
        Recorder.made.append(self)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)

    def close(self, finished: bool = True) -> None:
        self.closed = finished


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    Recorder.made = []
    monkeypatch.setattr(runner, "Progress", Recorder)
    return Recorder


def test_serving_progress_counts_completions_in_both_simulations(
    recorder: type[Recorder],
) -> None:
    config = ReplayConfig(
        capacity_blocks=300, mode="serving", model="llama-3.1-8b", token_budget=1024
    )
    result = runner.replay_path(CHAT, config, progress=True)
    (bar,) = recorder.made
    n = result.acc.totals.requests
    assert bar.total == 2 * n and "with and without cache" in bar.label
    assert sum(bar.updates) == 2 * n and bar.closed is True
    assert len(bar.updates) > 20  # counted step by step as requests complete, not up front


def test_trace_progress_has_a_total(recorder: type[Recorder]) -> None:
    runner.replay_path(TRACE, ReplayConfig(capacity_blocks=400), progress=True)
    (bar,) = recorder.made
    assert bar.total == 300 and sum(bar.updates) == 300 and bar.closed is True


def test_no_line_count_without_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: object) -> int:
        raise AssertionError("counted lines with progress off")

    monkeypatch.setattr(runner, "count_lines", fail)
    runner.replay_path(TRACE, ReplayConfig(capacity_blocks=400), progress=False)


def test_count_lines(tmp_path: Path) -> None:
    assert count_lines(TRACE) == 300
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"a": 1}\n{"a": 2}')
    assert count_lines(f) == 2
    f.write_bytes(b"")
    assert count_lines(f) == 0
    assert count_lines(tmp_path / "missing.jsonl") is None


def test_fallback_line_shows_share_and_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    err = io.StringIO()
    with redirect_stderr(err):
        bar = Progress(10_000, "replay x")
        for _ in range(5_000):  # redrawn after every FLUSH_EVERY (4,096) items
            bar.update()
        line = bar.line()
        bar.close()
    assert line.startswith("replay x: 4,096/10,000 (41%) req") and "left" in line
    assert "5,000/5,000 (100%)" in err.getvalue()  # a finished run ends at its count
