"""Counterfactual fleets: the hit rate the recorded traffic would have had with N-1, N+1 or 2N
replicas, or under another routing policy, answered by ``prefixcache replay`` run on the trace
the service records (``record_trace``), as a job of its own off the route path.

A job (``start``) copies the recorded window (the rotated files, oldest first, then the current
one, each up to what was flushed when it started) into a file of its own next to the trace
(removed when the job ends), then replays it once
per scenario, one ``python -m prefixcache replay`` process after another at a lower CPU
priority: the fleet mode with the scenario's replica count and policy, each replica of the
configured ``capacity_blocks`` (their mean when they differ; times ``record_trace.rate`` when
only a sample of requests is recorded), at the replicas' block size. The replay runs the
router's own policies over the replicas' own cache managers, so its answer is exact for what
it models: the prompts alone, one output token each, arrivals stretched ``TIME_SCALE`` times so
that no request waits for another. The load terms of ``least_loaded``, ``prefix_balanced`` and
``prefix_cost`` therefore see an idle fleet (the trace records neither output lengths nor the
engines' speed); ``command`` gives the replay to run by hand with ``--model``, ``--gpu`` and
``--output-len`` for a fleet under load.

``report`` answers the job's state (``idle``, ``running``, ``done``, ``failed``) and each
scenario's hit rate as it finishes. One job runs at a time; ``close`` stops it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from prefixcache.errors import InvalidArgumentError, PrefixCacheError
from prefixcache.fleet.policies import POLICIES
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.trace_recorder import TraceRecorder

TIME_SCALE = 1000.0  # the recorded arrivals stretched: no request waits for another
NICE = 10  # the replays' CPU priority below the service's
NOTE = (
    "prefixcache replay of the recorded trace: the prompts alone, one output token each, no "
    "request waiting for another (load-aware policies are judged by their cache choices)"
)


class CounterfactualUnavailableError(PrefixCacheError, RuntimeError):
    """A counterfactual job cannot start now (no trace recorded, one running already, ...)."""


class Scenario(NamedTuple):
    """One counterfactual: a fleet of ``replicas`` routed by ``policy``."""

    name: str
    replicas: int
    policy: str


def default_scenarios(replicas: int, policy: str) -> list[Scenario]:
    """The fleet as it is, N-1, N+1 and 2N replicas under its policy, and N replicas under each
    other policy."""
    out = [Scenario("as configured", replicas, policy)]
    for n, label in ((replicas - 1, "N-1"), (replicas + 1, "N+1"), (2 * replicas, "2N")):
        if n >= 1:
            out.append(Scenario(f"{label} replicas", n, policy))
    out += [Scenario(f"policy {p}", replicas, p) for p in POLICIES if p != policy]
    return out


class _ScenarioBody(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int
    policy: str | None = None


class CounterfactualBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/whatif/counterfactuals``: the scenarios to replay (default: every one of
    ``default_scenarios``)."""

    scenarios: list[_ScenarioBody] | None = None


def scenarios_of(
    body: CounterfactualBody, replicas: int, policy: str, max_replicas: int
) -> list[Scenario]:
    """The scenarios a request asks for; InvalidArgumentError for an unknown policy, a replica
    count outside 1..``max_replicas`` or an empty list."""
    if body.scenarios is None:
        return default_scenarios(replicas, policy)
    if not body.scenarios:
        raise InvalidArgumentError("'scenarios' is empty: leave it out for the default ones")
    out = []
    for i, s in enumerate(body.scenarios):
        p = policy if s.policy is None else s.policy
        if p not in POLICIES:
            raise InvalidArgumentError(
                f"scenarios[{i}].policy: unknown policy {p!r} (one of {', '.join(POLICIES)})"
            )
        if not 1 <= s.replicas <= max_replicas:
            raise InvalidArgumentError(
                f"scenarios[{i}].replicas must be in 1..{max_replicas}, got {s.replicas}"
            )
        out.append(Scenario(f"{s.replicas} replicas, {p}", s.replicas, p))
    return out


class _Fleet(NamedTuple):
    """What every scenario's replicas share: their cache and block size."""

    capacity_blocks: int
    block_size: int


class CounterfactualReplay:
    """Counterfactual jobs over the recorded trace (``start``, ``report``, ``close``;
    thread-safe)."""

    def __init__(
        self,
        recorder: TraceRecorder | None,
        replicas: Callable[[], Sequence[ReplicaSpec]],
        policy: str,
    ) -> None:
        self._recorder = recorder
        self._replicas = replicas
        self.policy = policy
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"state": "idle", "note": NOTE, "scenarios": []}
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def fleet(self) -> _Fleet:
        """The replicas' capacity and block size; CounterfactualUnavailableError when the
        recorded trace cannot answer for them."""
        if self._recorder is None:
            raise CounterfactualUnavailableError(
                "counterfactuals replay the recorded trace: start the service with "
                "--record-trace PATH (or record_trace.path in the config)"
            )
        specs = list(self._replicas())  # of one block size, or nothing is recorded
        known = [s.capacity_blocks for s in specs if s.capacity_blocks > 0]
        if not known:
            raise CounterfactualUnavailableError(
                "no replica has capacity_blocks in the config: a replay needs each replica's "
                "cache size"
            )
        capacity = sum(known) / len(known) * self._recorder.config.rate
        return _Fleet(max(1, round(capacity)), specs[0].block_size)

    def start(self, body: CounterfactualBody, max_replicas: int) -> dict[str, Any]:
        """Start a job replaying the recorded window for each scenario of ``body``; answers the
        job's state. CounterfactualUnavailableError when one runs already or nothing can be
        replayed, InvalidArgumentError for a bad scenario."""
        fleet = self.fleet()
        scenarios = scenarios_of(body, len(self._replicas()), self.policy, max_replicas)
        with self._lock:
            if self._state["state"] == "running" or self._stopping:
                raise CounterfactualUnavailableError(
                    "a counterfactual replay runs already: GET /v1/whatif/counterfactuals "
                    "says how far it got"
                )
            assert self._recorder is not None  # fleet() said so
            window = self._recorder.window()
            try:
                # next to the trace: on the disk sized for it, not a small /tmp
                where = self._recorder.path.parent
                work = Path(tempfile.mkdtemp(prefix=".counterfactual-", dir=where))
            except OSError:
                for f, _ in window:
                    f.close()
                raise
            self._state = {
                "state": "running",
                "started_at": round(time.time(), 3),
                "finished_at": None,
                "seconds": 0.0,
                "window_requests": None,  # counted as the window is copied
                "capacity_blocks": fleet.capacity_blocks,
                "block_size": fleet.block_size,
                "record_rate": self._recorder.config.rate,
                "note": NOTE,
                "command": " ".join(
                    ["prefixcache", *_command(Path("TRACE"), scenarios[0], fleet, Path("OUT"))[3:]]
                ),
                "scenarios": [
                    {"scenario": s.name, "replicas": s.replicas, "policy": s.policy,
                     "token_hit_rate": None, "seconds": None}
                    for s in scenarios
                ],
            }  # fmt: skip
            self._thread = threading.Thread(
                target=self._run,
                args=(window, work, scenarios, fleet),
                name="prefixcache-counterfactual",
                daemon=True,
            )
            self._thread.start()
            return self._copy()

    def _run(
        self,
        files: list[tuple[Any, int]],
        work: Path,
        scenarios: list[Scenario],
        fleet: _Fleet,
    ) -> None:
        """The job: the window into one file, then each scenario's replay."""
        began = time.monotonic()
        error: str | None = None
        try:
            trace = work / "window.jsonl"
            requests = _copy_window(files, trace)
            with self._lock:
                self._state["window_requests"] = requests
            if requests == 0:
                raise CounterfactualUnavailableError("no request has been recorded yet")
            for i, scenario in enumerate(scenarios):
                start = time.monotonic()
                rate = self._replay(_command(trace, scenario, fleet, work / f"run-{i}"))
                with self._lock:
                    row = self._state["scenarios"][i]
                    row["token_hit_rate"] = round(rate, 6)
                    row["seconds"] = round(time.monotonic() - start, 3)
                    self._state["seconds"] = round(time.monotonic() - began, 3)
        except Exception as exc:  # said in the state, never lost in a thread
            error = str(exc) or type(exc).__name__
        finally:
            for f, _ in files:
                f.close()
            shutil.rmtree(work, ignore_errors=True)
            with self._lock:
                self._state["state"] = "failed" if error is not None else "done"
                if error is not None:
                    self._state["error"] = error
                self._state["finished_at"] = round(time.time(), 3)
                self._state["seconds"] = round(time.monotonic() - began, 3)

    def _replay(self, command: list[str]) -> float:
        """One scenario's replay: its token hit rate (from the report it prints)."""
        with self._lock:
            if self._stopping:
                raise CounterfactualUnavailableError("the service stopped the replay")
            process = self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        try:
            with contextlib.suppress(OSError):  # else at the service's priority
                os.setpriority(os.PRIO_PROCESS, process.pid, NICE)
            out, err = process.communicate()
        finally:
            with self._lock:
                self._process = None
        if process.returncode != 0:
            if self._stopping:
                raise CounterfactualUnavailableError("the service stopped the replay")
            tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise CounterfactualUnavailableError(
                f"the replay exited with status {process.returncode}: {' '.join(tail)}"
            )
        try:
            return float(msgspec.json.decode(out)["token_hit_rate"])
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            message = f"the replay's report is unreadable: {exc}"
            raise CounterfactualUnavailableError(message) from None

    def report(self) -> dict[str, Any]:
        """The last job's state: ``state``, when it ran, the window it replayed, the replicas'
        size, the command of the first scenario and each scenario's ``token_hit_rate`` (None
        until its replay is done)."""
        with self._lock:
            return self._copy()

    def _copy(self) -> dict[str, Any]:
        state = dict(self._state)
        state["scenarios"] = [dict(row) for row in self._state["scenarios"]]
        return state

    def close(self) -> None:
        """Stop a running job (the service stops)."""
        with self._lock:
            self._stopping = True
            process, thread = self._process, self._thread
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
        if thread is not None:
            thread.join(timeout=10)


def _copy_window(files: list[tuple[Any, int]], trace: Path) -> int:
    """The window's files, each up to its size when the job started, into ``trace``; answers
    the lines (requests) copied."""
    lines = 0
    with open(trace, "wb") as out:
        for f, size in files:
            left = size
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                lines += chunk.count(b"\n")
                left -= len(chunk)
    return lines


def _command(trace: Path, scenario: Scenario, fleet: _Fleet, out: Path) -> list[str]:
    """The ``prefixcache replay`` command of one scenario over ``trace``."""
    return [
        sys.executable, "-m", "prefixcache", "replay", str(trace),
        "--mode", "serving", "--replicas", str(scenario.replicas), "--routing", scenario.policy,
        "--blocks", str(fleet.capacity_blocks), "--block-size", str(fleet.block_size),
        "--trace-format", "mooncake", "--trace-block-size", str(fleet.block_size),
        "--output-len", "1", "--time-scale", f"{TIME_SCALE:g}", "--model", "llama-3.1-8b",
        "--no-upper-bound", "--jobs", "1", "--no-progress", "--format", "json",
        "--out", str(out),
    ]  # fmt: skip
