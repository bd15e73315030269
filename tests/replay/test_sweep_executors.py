"""Choosing where a sweep runs: bad choices are one error line, before anything runs."""

from __future__ import annotations

import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.replay import ReplayConfig
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
