"""A serving replay's passes that read nothing of the cached one in a second process (a fleet's
no-cache and pooled passes, a single replica's no-cache pass): the same run as one pass after
another, no second process left behind (Ctrl-C, a child that dies), none in a sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefixcache.cli import main
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.runner import _replay, replay_sweep
from prefixcache.replay.sim import serving_passes
from prefixcache.replay.sim.fleet import simulator as fleet_replay
from prefixcache.replay.sim.side_process import SideRun

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests" / "golden" / "chat_small.yaml"
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
BIG_CHAT = ROOT / "scenarios" / "multi_turn_chat.yaml"
GIB = 1 << 30

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not hasattr(os, "fork"), reason="the second process is forked"
)


class CountedSideRun(SideRun[Any]):
    """A ``SideRun`` that counts the ones made in this process."""

    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CountedSideRun.made += 1
        super().__init__(*args, **kwargs)


def report(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The report of a serving replay (llama-3.1-8b), timings left out."""
    config = ReplayConfig(mode="serving", model="llama-3.1-8b", **options)
    result = _replay(open_source(path, config), config.resolve(), False)
    out = result.to_report_dict()
    out["replay_seconds"] = out["requests_per_second"] = None
    return out


def side_processes(monkeypatch: pytest.MonkeyPatch, usable: bool, made: Any = None) -> None:
    """Say whether a second core is usable, and what makes the second process."""
    for module in (fleet_replay, serving_passes):
        monkeypatch.setattr(module, "side_process_available", lambda: usable)
        if made is not None:
            monkeypatch.setattr(module, "SideRun", made)


CASES = {
    "chat": (CHAT, {"capacity_blocks": 300, "replicas": 3}),
    "chat-pool": (CHAT, {"capacity_blocks": 100, "pool_memory": GIB, "replicas": 2}),
    "trace-host-and-pool": (
        SAMPLE,
        {
            "capacity_blocks": 100,
            "block_size": 512,
            "host_memory": 16 * GIB,
            "pool_memory": 64 * GIB,
            "replicas": 2,
        },
    ),
    "chat-one-replica": (CHAT, {"capacity_blocks": 150}),
    "trace-one-replica-host": (
        SAMPLE,
        {"capacity_blocks": 100, "block_size": 512, "host_memory": 16 * GIB},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_side_process_reports_what_one_process_does(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, options = CASES[case]
    side_processes(monkeypatch, False)
    alone = report(path, options)
    CountedSideRun.made = 0
    side_processes(monkeypatch, True, CountedSideRun)
    beside = report(path, options)
    assert CountedSideRun.made == 1
    assert json.dumps(beside, sort_keys=True) == json.dumps(alone, sort_keys=True)


@pytest.mark.parametrize(("case", "victim"), [("chat", "run_pooled"), ("chat-one-replica", "")])
def test_a_side_process_that_dies_leaves_its_passes_to_this_one(
    case: str, victim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that ends without its figures (here: killed in the fleet's pooled pass, or in
    the single replica's no-cache pass) costs time, not figures: this process runs the passes
    itself."""
    path, options = CASES[case]
    side_processes(monkeypatch, False)
    alone = report(path, options)
    here = os.getpid()

    class DyingSideRun(CountedSideRun):
        def __init__(self, work: Any, *args: Any, **kwargs: Any) -> None:
            def dying(count: Any, stage: Any) -> Any:
                if not victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                return work(count, stage)

            super().__init__(dying, *args, **kwargs)

    if victim:
        run_pooled = fleet_replay.run_pooled

        def pooled(*args: Any, **kwargs: Any) -> Any:
            if os.getpid() != here:  # the child
                os.kill(os.getpid(), signal.SIGKILL)
            return run_pooled(*args, **kwargs)

        monkeypatch.setattr(fleet_replay, "run_pooled", pooled)
    CountedSideRun.made = 0
    side_processes(monkeypatch, True, DyingSideRun)
    beside = report(path, options)
    assert CountedSideRun.made == 1
    assert json.dumps(beside, sort_keys=True) == json.dumps(alone, sort_keys=True)


MULTI_TENANT = ROOT / "scenarios" / "multi_tenant.yaml"
SHADOW_CASES = {
    "chat": (CHAT, {"capacity_blocks": 150}),
    "tenants": (MULTI_TENANT, {"capacity_blocks": 200}),  # namespaces: isolation misses
    "trace-host": (SAMPLE, {"capacity_blocks": 100, "block_size": 512, "host_memory": 16 * GIB}),
    "too-large": (SAMPLE, {"capacity_blocks": 30, "block_size": 512}),  # rejected requests
}


def rows_and_report(path: Path, options: dict[str, Any]) -> tuple[bytes, str, int]:
    """A one-replica serving replay's request rows, its report (timings left out) and the
    prefixes its own shadow holds at the end."""
    config = ReplayConfig(mode="serving", model="llama-3.1-8b", **options)
    result = _replay(open_source(path, config), config.resolve(), False)
    out = result.to_report_dict()
    out["replay_seconds"] = out["requests_per_second"] = None
    assert result.acc.log is not None
    rows = b"".join(ints.tobytes() + times.tobytes() for ints, times in result.acc.log.chunks())
    return rows, json.dumps(out, sort_keys=True), len(result.acc.shadow.seen)


@pytest.mark.parametrize("case", list(SHADOW_CASES))
def test_the_shadow_made_beside_gives_the_same_rows_and_report(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a second process, a single replica's cached pass logs the shadow's observations
    and the second process makes them: every row's misses and every figure as when the
    shadow is made in the pass itself (which then holds the prefixes; here none)."""
    path, options = SHADOW_CASES[case]
    side_processes(monkeypatch, False)
    rows, text, held = rows_and_report(path, options)
    assert held > 0
    side_processes(monkeypatch, True)
    rows_beside, text_beside, held_beside = rows_and_report(path, options)
    assert held_beside == 0  # made in the second process
    assert text_beside == text
    assert rows_beside == rows


def test_a_side_process_that_dies_in_the_shadow_leaves_it_to_this_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed after its no-cache pass, while making the shadow: this process makes it from
    the log it kept, and the no-cache pass again; the rows and the report are the same."""
    path, options = SHADOW_CASES["tenants"]
    side_processes(monkeypatch, False)
    expected = rows_and_report(path, options)[:2]
    here = os.getpid()
    finish, answer = serving_passes.finish_shadow, serving_passes.answer_shadow
    made_here = []

    def dying(*args: Any, **kwargs: Any) -> Any:
        assert os.getpid() != here  # the child, with the workload read and its pass done
        os.kill(os.getpid(), signal.SIGKILL)
        return finish(*args, **kwargs)

    def answered_here(*args: Any, **kwargs: Any) -> Any:
        made_here.append(os.getpid() == here)
        return answer(*args, **kwargs)

    monkeypatch.setattr(serving_passes, "finish_shadow", dying)
    monkeypatch.setattr(serving_passes, "answer_shadow", answered_here)
    side_processes(monkeypatch, True)
    assert rows_and_report(path, options)[:2] == expected
    assert made_here == [True]


@pytest.mark.parametrize("case", ["chat", "chat-one-replica"])
def test_a_fork_that_fails_runs_every_pass_here(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, options = CASES[case]
    side_processes(monkeypatch, False)
    alone = report(path, options)

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise BlockingIOError(11, "Resource temporarily unavailable")  # fork's EAGAIN

    side_processes(monkeypatch, True, no_process)
    assert json.dumps(report(path, options), sort_keys=True) == json.dumps(alone, sort_keys=True)


@pytest.mark.parametrize("replicas", [1, 2])
def test_no_point_of_a_sweep_starts_a_second_process(
    replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's points already take the cores (worker processes forked from this one inherit
    the patch below, so any point that made a ``SideRun`` would fail the sweep)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a sweep point started a second process")

    side_processes(monkeypatch, True, refuse)
    configs = [
        ReplayConfig(mode="serving", model="llama-3.1-8b", capacity_blocks=c, replicas=replicas)
        for c in (200, 300, 400)
    ]
    result = replay_sweep(CHAT, configs, jobs=2)
    assert result.sweep is not None and len(result.sweep) == 3


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_error_in_the_fleet_pass_ends_the_second_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet pass refuses a second model after the second process has started: one line,
    exit 2, and no process of this one left running."""
    CountedSideRun.made = 0
    side_processes(monkeypatch, True, CountedSideRun)
    trace = tmp_path / "two_models.jsonl"
    lines = [
        {"timestamp": 0, "model": "a", "token_ids": list(range(40))},
        {"timestamp": 1, "model": "b", "token_ids": list(range(40))},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["replay", str(trace), "--mode", "serving", "--blocks", "100", "--replicas", "2"]
    before = set(_children(os.getpid()))
    assert main([*args, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "serves one model" in err and "Traceback" not in err
    assert CountedSideRun.made == 1
    assert not [c for c in _children(os.getpid()) if c not in before and _running(c)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("replicas", ["4", "1"])
def test_ctrl_c_ends_both_processes_without_a_traceback(tmp_path: Path, replicas: str) -> None:
    """Ctrl-C reaches the whole foreground process group: the replay says it was interrupted,
    writes no run, and its second process ends with it."""
    cmd = [
        sys.executable,
        "-m",
        "prefixcache",
        "replay",
        str(BIG_CHAT),
        "--mode",
        "serving",
        "--model",
        "llama-3.1-8b",
        "--kv-memory",
        "4GiB",
        "--replicas",
        replicas,
        "--out",
        str(tmp_path / "run"),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while not children and proc.poll() is None and time.monotonic() < deadline:
            children = _children(proc.pid)
            time.sleep(0.05)
        assert children, "the replay started no second process"
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted; no run written" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not (tmp_path / "run").exists()
    assert not any(_running(c) for c in children)
