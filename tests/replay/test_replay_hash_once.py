"""A fleet replay hashes each prompt once: the router's route, the pool's lookup and the report's
"cached on another replica" figure all read the digests the replay computed for the request
(before, a fleet-with-pool replay hashed a prompt's blocks up to four times). The managers hash
only the blocks they index, and the fleet index takes the digests their events carry."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from prefixcache.blocks import hashing
from prefixcache.replay import ReplayConfig
from prefixcache.replay.runner import replay_path
from prefixcache.replay.sim import accounting, serving
from prefixcache.replay.sim.fleet import simulator

SAMPLE = Path(__file__).resolve().parents[2] / "scenarios" / "traces" / "mooncake_sample.jsonl"


@pytest.mark.skipif(
    not (accounting.__file__ or "").endswith(".py")
    or not (serving.__file__ or "").endswith(".py")
    or not (simulator.__file__ or "").endswith(".py"),
    reason="compiled modules have no Python frames, so a digest's asker cannot be told apart; "
    "make test-pure runs this on the Python sources",
)
def test_a_fleet_replay_with_a_pool_hashes_each_prompt_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: Counter[str] = Counter()  # digests computed in the fleet pass, by the file asking
    fleet_file = simulator.__file__  # FleetSimulator's source, read by path (names repeat)
    digest = hashing.HASH_FUNCTIONS["xxh3_128"]

    def counted(data: bytes) -> bytes:
        frame = sys._getframe(1)
        while frame.f_code.co_filename.endswith("hashing.py"):
            frame = frame.f_back  # type: ignore[assignment]
        asker = frame.f_code.co_filename
        asker = "simulator" if asker == fleet_file else asker.rsplit("/", 1)[-1]
        fleet_pass = False
        f = frame
        while f is not None:  # under FleetSimulator.run (not the pooled line's pass)
            code = f.f_code
            fleet_pass |= code.co_filename == fleet_file and code.co_name == "run"
            f = f.f_back  # type: ignore[assignment]
        if fleet_pass:
            calls[asker] += 1
        return digest(data)

    # hashers take their function when built: every one the replay builds counts
    monkeypatch.setitem(hashing.HASH_FUNCTIONS, "xxh3_128", counted)
    config = ReplayConfig(
        capacity_blocks=300,
        model="llama-3.1-8b",
        mode="serving",
        replicas=3,
        pool_memory=64 * 1024**3,
        pool_write="through",
    )
    blocks = replay_path(SAMPLE, config).to_report_dict()["prompt_blocks"]
    assert blocks > 0
    print(dict(calls), "prompt blocks:", blocks)
    # once per prompt block, by the replay (and a namespace's seed, once per hasher); the
    # no-cache fleet routes over an index that stays empty and hashes nothing
    assert blocks <= calls["simulator"] <= blocks + 4
    for asker in ("router.py", "admission.py"):  # the routes and the pool read those
        assert calls[asker] == 0, asker
