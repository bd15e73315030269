"""The shadow fleets in their own process: the same answers as in the router's process; a
child killed mid-run is reported, never raised, and routing goes on; a child stopped
(SIGSTOP) makes a report say it did not answer and the queue drop what it cannot hold, and
once it runs again it answers again; closing stops the child."""

from __future__ import annotations

import os
import signal
import time

import pytest

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif import shadow_process
from prefixcache.fleet.whatif.shadow_fleets import ShadowFleets
from prefixcache.fleet.whatif.shadow_process import ShadowProcess
from tests.fleet.test_whatif_shadows import NS, _prompts

B = 16
SPECS = [ReplicaSpec(n, NS, B, 400) for n in ("a", "b", "c")]


def _chains(n: int = 300) -> list[tuple[list[bytes], int]]:
    hasher = BlockHasher(B)
    return [(hasher.hash_prompt(p, NS), len(p)) for p in _prompts(n)]


@pytest.fixture
def shadows():
    process = ShadowProcess(SPECS, "prefix", 0.5)
    yield process
    process.close()


def test_the_child_answers_as_the_fleets_in_this_process(shadows):
    here = ShadowFleets(SPECS, "prefix", 0.5)
    for digests, tokens in _chains():
        here.offer(digests, tokens)
        shadows.offer(digests, tokens)
    report = shadows.report()
    assert report.pop("dropped_requests") == 0 and report.pop("cpu_seconds") > 0
    assert report == here.report()
    assert report["routed_requests"] == 300 and len(report["scenarios"]) == 8


def test_a_killed_child_is_reported_and_routing_goes_on(shadows):
    chains = _chains(50)
    for digests, tokens in chains:
        shadows.offer(digests, tokens)
    assert shadows.report()["routed_requests"] == 50
    os.kill(shadows._process.pid, signal.SIGKILL)
    shadows._process.wait(timeout=10)
    for digests, tokens in chains:  # never raises on the route path
        shadows.offer(digests, tokens)
    report = shadows.report()
    assert "stopped (exit code -9)" in report["error"] and report["scenarios"] == []
    assert shadows.report()["error"] == report["error"]  # and stays said


def test_a_stopped_child_times_out_drops_and_comes_back(shadows, monkeypatch):
    monkeypatch.setattr(shadow_process, "REPLY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(shadow_process, "MAX_QUEUED", 2_000)
    chains = _chains(100)
    pid = shadows._process.pid
    shadows.report()  # the child is up and reading
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        for _ in range(60):  # 6,000 prompts: the pipe fills, then the queue
            for digests, tokens in chains:
                shadows.offer(digests, tokens)
        offered = time.monotonic() - start
        report = shadows.report()
        assert "did not answer" in report["error"] and report["scenarios"] == []
        assert report["dropped_requests"] > 0
    finally:
        os.kill(pid, signal.SIGCONT)
    for _ in range(60):  # it works through what reached it, then answers again
        report = shadows.report()
        if "error" not in report:
            break
    assert "error" not in report, report.get("error")
    assert report["routed_requests"] + report["dropped_requests"] == 6_000
    assert report["routed_requests"] >= 2_000
    assert offered < 30  # the route path never waited on the stopped child (no timing bound)


def test_close_stops_the_child():
    process = ShadowProcess(SPECS, "prefix", 0.5)
    process.report()
    child = process._process
    process.close()
    assert child.poll() == 0  # it has stopped, by itself
