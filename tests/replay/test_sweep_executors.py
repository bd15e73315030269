"""Choosing where a sweep runs: bad choices are one error line, before anything runs."""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import ClassVar

import pytest

from prefixcache.cli import main
from prefixcache.replay import ReplayConfig, runner
from prefixcache.replay.progress import SweepProgress
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.sweep_executors import ProcessExecutor, SweepExecutor, open_executor

CHAT = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"


def run_cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def test_a_ray_address_needs_the_ray_executor(tmp_path: Path) -> None:
    code, err = run_cli(
        "replay", str(CHAT), "--blocks", "100", "--ray-address", "auto", "--out", str(tmp_path)
    )
    assert code == 2
    assert err == "prefixcache replay: error: --ray-address needs --executor ray\n"


def test_the_ray_executor_without_ray_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    code, err = run_cli(
        "replay", str(CHAT), "--blocks", "100,200", "--executor", "ray", "--out", str(tmp_path)
    )
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'prefixcache[ray]'" in err


def _where(path: str, config: ResolvedConfig) -> dict:
    return {"pid": os.getpid(), "blocks": config.capacity_blocks}


def test_local_points_run_in_other_processes_as_soon_as_there_is_one_job_to_spare() -> None:
    configs = [ReplayConfig(capacity_blocks=b).resolve() for b in (10, 20, 30)]
    assert type(open_executor("local", 0)) is SweepExecutor  # --jobs 1: all in this process
    with open_executor("local", 1) as executor:  # --jobs 2: this process and one worker
        assert isinstance(executor, ProcessExecutor)
        rows = dict(executor.start(_where, str(CHAT), configs))
    assert [rows[i]["blocks"] for i in range(3)] == [10, 20, 30]
    assert all(row["pid"] != os.getpid() for row in rows.values())


# made before any worker forks, so every worker shares them
_FORK = (
    multiprocessing.get_context("fork")
    if "fork" in multiprocessing.get_all_start_methods()
    else None
)
_STARTED = _FORK.Event() if _FORK is not None else None
_GATE = _FORK.Event() if _FORK is not None else None


def _held_in_workers(path: str, config: ResolvedConfig) -> dict:
    """In a worker: say so, then hold on until the test lets go, so the points behind it wait
    for this process to take them. Here: run at once."""
    if os.getpid() != MAIN_PID and _STARTED is not None and _GATE is not None:
        _STARTED.set()
        _GATE.wait(60)
    return {"pid": os.getpid(), "blocks": config.capacity_blocks}


MAIN_PID = os.getpid()


@pytest.mark.skipif(_FORK is None, reason="needs the fork start method")
def test_this_process_takes_the_points_no_worker_started() -> None:
    """Once its own point is done, the sweep's process runs the points still waiting for a
    worker, instead of idling until the workers get to them."""
    assert _STARTED is not None and _GATE is not None
    configs = [ReplayConfig(capacity_blocks=b).resolve() for b in (10, 20, 30, 40, 50)]
    rows: dict[int, dict] = {}
    with open_executor("local", 1) as executor:
        done = executor.start(_held_in_workers, str(CHAT), configs)
        assert _STARTED.wait(60)  # the worker holds the first point
        here = dict(executor.run_waiting())
        _GATE.set()
        rows = {**dict(done), **here}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [rows[i]["blocks"] for i in range(5)] == [10, 20, 30, 40, 50]
    assert rows[0]["pid"] != MAIN_PID  # the worker's
    # the pool hands its one worker at most two points ahead of the one it runs (its call
    # queue holds max_workers + 1); the rest ran here
    assert {3, 4} <= set(here) and all(rows[i]["pid"] == MAIN_PID for i in here)


class SweepRecorder(SweepProgress):
    """The sweep's bar, counting instead of drawing."""

    made: ClassVar[list[SweepRecorder]] = []

    def __init__(self, total: int | None, label: str, shared: object) -> None:
        self.total, self.label, self.shared, self._seen = total, label, shared, 0
        self.counted = 0
        self.closed: bool | None = None
        SweepRecorder.made.append(self)

    def update(self, n: int = 1) -> None:
        self.counted += n

    def close(self, finished: bool = True) -> None:
        self.poll()
        self.closed = finished


@pytest.mark.parametrize(("mode", "passes"), [("sequential", 1), ("serving", 2)])
def test_one_bar_counts_every_point_wherever_it_ran(
    monkeypatch: pytest.MonkeyPatch, mode: str, passes: int
) -> None:
    SweepRecorder.made = []
    monkeypatch.setattr(runner, "SweepProgress", SweepRecorder)
    configs = [ReplayConfig(capacity_blocks=b, mode=mode) for b in (100, 200, 400)]
    result = runner.replay_sweep(CHAT, configs, jobs=2, progress=True)
    (bar,) = SweepRecorder.made
    n = result.acc.totals.requests
    assert len(result.sweep) == 3
    assert bar.total == 3 * passes * n and "3 points" in bar.label
    assert bar.counted == bar.total and bar.closed is True
