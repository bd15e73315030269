"""Progress of a replay: serving counts completed requests; traces get a total up front."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr
from pathlib import Path
from typing import ClassVar

import pytest

from prefixcache.replay import progress, runner
from prefixcache.replay.progress import Progress, count_lines
from prefixcache.replay.run_config import ReplayConfig
from prefixcache.replay.sim.fleet import simulator as fleet_replay

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
        self.stages: list[tuple[str, int]] = []  # each stage named, with the count before it
        self.events: list[str] = []
        Recorder.made.append(self)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)
        self.events.append("update")

    def stage(self, name: str) -> None:
        self.stages.append((name, sum(self.updates)))
        self.events.append("stage")

    def close(self, finished: bool = True) -> None:
        self.closed = finished
        self.events.append("close")


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


def test_fleet_progress_covers_every_pass(
    recorder: type[Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet replay runs the fleet, the fleet without cache and the pooled cache: the bar
    counts each request completing in every pass and closes, finished, after the last."""
    passes: list[str] = []
    run_pooled = fleet_replay.run_pooled

    def pooled(*args: object, **kwargs: object) -> object:
        passes.append("pooled ran")
        return run_pooled(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_replay, "run_pooled", pooled)
    monkeypatch.setattr(fleet_replay, "side_process_available", lambda: False)  # one by one
    config = ReplayConfig(
        capacity_blocks=300, mode="serving", model="llama-3.1-8b", replicas=2, max_seqs=16
    )
    result = runner.replay_path(CHAT, config, progress=True)
    (bar,) = recorder.made
    n = result.acc.totals.requests
    assert passes == ["pooled ran"]
    assert bar.total == 3 * n
    # each pass is named when it starts, after the passes before it completed every request
    assert bar.stages == [("fleet", 0), ("fleet without cache", n), ("pooled cache", 2 * n)]
    assert sum(bar.updates) == 3 * n and bar.closed is True
    assert bar.events[-1] == "close" and bar.events.count("close") == 1
    # counted as requests complete in every pass, not all at once
    chunks = [e for e in "".join("s" if e == "stage" else "u" for e in bar.events).split("s")]
    assert [len(c) > 5 for c in chunks[1:]] == [True, True, True]


def test_the_bar_is_redrawn_by_time_between_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow items (a fleet step can take milliseconds) still move the bar about twice a
    second: the bar is redrawn after REFRESH_S seconds even short of FLUSH_EVERY items."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    err = io.StringIO()
    with redirect_stderr(err):
        bar = Progress(10_000, "replay x")
        for _ in range(100):  # 100 items in 10 s, one every 0.1 s
            now[0] += 0.1
            bar.update()
        drawn = err.getvalue()
        bar.close()
    assert drawn.count("\r") >= 15  # at least one redraw a second
    assert "replay x: 95/10,000" in drawn or "replay x: 96/10,000" in drawn


def test_stage_names_the_pass_on_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with redirect_stderr(io.StringIO()):
        bar = Progress(10, "replay x (2 passes)")
        bar.stage("fleet")
        bar.stage("pooled cache")
        line = bar.line()
        bar.close()
    assert line.startswith("replay x (2 passes) [pooled cache]: 0/10")


def test_fleet_progress_with_the_side_passes_beside_the_fleet(
    recorder: type[Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the no-cache and pooled passes in a second process, the bar counts every request of
    the three passes once, names the passes running together, and closes finished."""
    monkeypatch.setattr(fleet_replay, "side_process_available", lambda: True)
    config = ReplayConfig(
        capacity_blocks=300, mode="serving", model="llama-3.1-8b", replicas=2, max_seqs=16
    )
    result = runner.replay_path(CHAT, config, progress=True)
    (bar,) = recorder.made
    n = result.acc.totals.requests
    assert bar.total == 3 * n and sum(bar.updates) == 3 * n and bar.closed is True
    assert all(u > 0 for u in bar.updates)
    names = [name for name, _ in bar.stages]
    assert names[0] == "fleet + fleet without cache"
    assert set(names) <= {
        "fleet + fleet without cache",
        "fleet + pooled cache",
        "fleet",
        "fleet without cache",
        "pooled cache",
    }
    assert bar.events[-1] == "close" and bar.events.count("close") == 1
