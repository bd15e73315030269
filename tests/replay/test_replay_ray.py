"""Sweeps on Ray: the points run as tasks on a local Ray instance, the report is the local one's."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.replay import ReplayConfig
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.sweep_executors import RayExecutor

ray = pytest.importorskip("ray", reason="the Ray executor needs the 'ray' package (extra 'ray')")

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests" / "golden" / "chat_small.yaml"
SWEEP_ARGS = ("--blocks", "120,400", "--policy", "lru,lfu", "--block-size", "16,32")
RUN_DEPENDENT = ("replay_seconds", "requests_per_second")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _report(run_dir: Path) -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    for key in RUN_DEPENDENT:
        report.pop(key)
    return report


def _cli(*args: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    assert code == 0, err.getvalue()


def test_a_ray_sweep_reports_what_a_local_one_does(local_ray: None, tmp_path: Path) -> None:
    _cli("replay", str(CHAT), *SWEEP_ARGS, "--jobs", "1", "--out", str(tmp_path / "local"))
    _cli("replay", str(CHAT), *SWEEP_ARGS, "--executor", "ray", "--out", str(tmp_path / "ray"))
    local, on_ray = _report(tmp_path / "local"), _report(tmp_path / "ray")
    assert len(on_ray["sweep"]) == 8
    assert on_ray == local
    for name in ("requests.csv", "timeline.csv"):
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert ray.is_initialized()  # an instance the sweep did not start is left running


def test_points_run_as_ray_tasks_and_stream_back(local_ray: None) -> None:
    configs = [ReplayConfig(capacity_blocks=b).resolve() for b in (100, 200, 300)]

    def point(path: str, config: ResolvedConfig) -> dict:
        context = ray.get_runtime_context()
        return {"task": context.get_task_id(), "pid": os.getpid(), "blocks": config.capacity_blocks}

    with RayExecutor(None) as executor:
        finished = executor.start(point, str(CHAT), configs)
        first = next(finished)  # rows come back one at a time, as tasks finish
        rows = dict([first, *finished])
    assert sorted(rows) == [0, 1, 2]
    assert [rows[i]["blocks"] for i in range(3)] == [100, 200, 300]
    assert all(r["task"] and r["pid"] != os.getpid() for r in rows.values())
    assert len({r["task"] for r in rows.values()}) == 3
    assert ray.is_initialized()
