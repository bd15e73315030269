"""The event-driven serving loop reports exactly what the step-by-step simulation reported.

``stepwise_serving`` and ``stepwise_fleet`` are the simulation as it was before the loop jumped
from event to event: every decode step of every running request simulated one by one, the
no-cache pass on a real manager with caching off. Each case replays a workload both ways and
compares the run directories byte for byte: report.json (but the wall time), requests.csv and
timeline.csv. The cases cover every shipped scenario and trace, fleets under every routing
policy, host tiers and the shared pool in both write modes, tenant shares, parallel samples,
preemption, chunked prefills, small budgets and one-token blocks; the public Mooncake trace too
when it is on this machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import stepwise_fleet
import stepwise_serving

from prefixcache import CacheManager
from prefixcache.errors import OutOfBlocksError, RequestTooLargeError
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.model_specs import get_gpu, get_model
from prefixcache.replay.run_result import write_run
from prefixcache.replay.runner import _replay
from prefixcache.replay.share_specs import parse_shares
from prefixcache.replay.sim import serving_passes
from prefixcache.replay.sim.fleet import simulator as fleet_replay
from prefixcache.replay.sim.roofline import Roofline
from prefixcache.replay.sim.uncached_blocks import UncachedBlocks

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "scenarios"
CHAT = ROOT / "tests" / "golden" / "chat_small.yaml"
SAMPLE = SCENARIOS / "traces" / "mooncake_sample.jsonl"
NOISY = SCENARIOS / "traces" / "noisy_neighbour.jsonl"
FULL_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
GIB = 1024**3
RUN_FILES = ("requests.csv", "timeline.csv")

SHIPPED = sorted(SCENARIOS.glob("*.yaml")) + sorted(SCENARIOS.glob("*.toml"))

# (id, source, requests (None: all), options): every one replayed both ways
CASES: list[tuple[str, Path, int | None, dict[str, Any]]] = [
    ("chat", CHAT, None, {"capacity_blocks": 300, "token_budget": 1024}),
    ("chat-preempting", CHAT, None, {"capacity_blocks": 60, "token_budget": 256}),
    ("chat-one-token-blocks", CHAT, None, {"capacity_blocks": 300, "block_size": 1}),
    ("chat-two-token-blocks", CHAT, None, {"capacity_blocks": 300, "block_size": 2}),
    ("chat-32-token-blocks", CHAT, None, {"capacity_blocks": 100, "block_size": 32}),
    ("chat-four-sequences", CHAT, None, {"capacity_blocks": 300, "max_seqs": 4}),
    ("chat-tiny-budget", CHAT, None, {"capacity_blocks": 150, "token_budget": 64}),
    ("chat-lfu", CHAT, None, {"capacity_blocks": 150, "policy": "lfu"}),
    ("chat-priority", CHAT, None, {"capacity_blocks": 150, "policy": "priority"}),
    ("chat-no-partial-copy", CHAT, None, {"capacity_blocks": 150, "partial_copy": False}),
    ("chat-fast-arrivals", CHAT, None, {"capacity_blocks": 150, "rate_scale": 4.0}),
    ("chat-host-tier", CHAT, None, {"capacity_blocks": 100, "host_memory": GIB}),
    ("sample", SAMPLE, None, {"capacity_blocks": 400, "block_size": 512}),
    ("sample-preempting", SAMPLE, None, {"capacity_blocks": 100, "block_size": 512}),
    (
        "sample-continuations",
        SAMPLE,
        None,
        {"capacity_blocks": 400, "block_size": 512, "continuations": True},
    ),
    ("sample-16-token-blocks", SAMPLE, 150, {"capacity_blocks": 2000}),
    ("noisy-shares", NOISY, None, {"capacity_blocks": 64, "shares": parse_shares("steady=40")}),
    (
        "noisy-shares-capped",
        NOISY,
        None,
        {"capacity_blocks": 48, "shares": parse_shares("steady=20:30,bursty=0:50%")},
    ),
    # fleets
    ("fleet-chat", CHAT, None, {"capacity_blocks": 300, "replicas": 2}),
    (
        "fleet-round-robin",
        CHAT,
        None,
        {"capacity_blocks": 100, "replicas": 3, "routing": "round_robin"},
    ),
    (
        "fleet-prefix-balanced",
        CHAT,
        None,
        {"capacity_blocks": 100, "replicas": 4, "routing": "prefix_balanced"},
    ),
    (
        "fleet-prefix",
        SAMPLE,
        None,
        {"capacity_blocks": 200, "block_size": 512, "routing": "prefix", "replicas": 2},
    ),
    ("fleet-sample", SAMPLE, None, {"capacity_blocks": 400, "block_size": 512, "replicas": 4}),
    ("fleet-pool", CHAT, None, {"capacity_blocks": 100, "pool_memory": GIB, "replicas": 2}),
    (
        "fleet-pool-write-through",
        CHAT,
        None,
        {"capacity_blocks": 100, "pool_memory": GIB, "replicas": 3, "pool_write": "through"},
    ),
    (
        "fleet-host-and-pool",
        SAMPLE,
        None,
        {
            "capacity_blocks": 100,
            "block_size": 512,
            "host_memory": 16 * GIB,
            "pool_memory": 64 * GIB,
            "replicas": 2,
        },
    ),
    (
        "fleet-shares",
        NOISY,
        None,
        {"capacity_blocks": 64, "shares": parse_shares("steady=40"), "replicas": 2},
    ),
]
for _path in SHIPPED:
    CASES.append((_path.stem, _path, 300, {"capacity_blocks": 1500}))
    CASES.append((f"{_path.stem}-tight", _path, 300, {"capacity_blocks": 300, "token_budget": 512}))
    CASES.append((f"{_path.stem}-fleet", _path, 200, {"capacity_blocks": 400, "replicas": 2}))


@contextmanager
def step_by_step() -> Iterator[None]:
    """Replays in this block run the step-by-step simulation."""
    was = serving_passes.run_serving, fleet_replay.run_fleet
    serving_passes.run_serving = stepwise_serving.run_serving  # type: ignore[assignment]
    fleet_replay.run_fleet = stepwise_fleet.run_fleet  # type: ignore[assignment]
    try:
        yield
    finally:
        serving_passes.run_serving, fleet_replay.run_fleet = was


def run_dir(path: Path, n: int | None, options: dict[str, Any], out: Path) -> dict[str, bytes]:
    """Replay in serving mode (llama-3.1-8b on an H100) and read back what the run wrote."""
    config = ReplayConfig(mode="serving", model="llama-3.1-8b", **options)
    source = open_source(path, config)
    if n is not None:
        source = source.head(n)
    result = _replay(source, config.resolve(), False)
    write_run(result, out, result.to_report_dict())
    report = json.loads((out / "report.json").read_text())
    report["replay_seconds"] = report["requests_per_second"] = None
    files = {name: (out / name).read_bytes() for name in RUN_FILES}
    files["report.json"] = json.dumps(report, indent=1, sort_keys=True).encode()
    return files


def assert_same_run(path: Path, n: int | None, options: dict[str, Any], tmp: Path) -> None:
    with step_by_step():
        before = run_dir(path, n, options, tmp / "step-by-step")
    after = run_dir(path, n, options, tmp / "event-driven")
    for name, data in before.items():
        if data != after[name]:
            old, new = data.decode().splitlines(), after[name].decode().splitlines()
            first = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
            raise AssertionError(
                f"{name} differs at line {first}: {old[first]!r} != {new[first]!r}"
            )


@pytest.mark.parametrize(
    ("path", "n", "options"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_event_loop_reports_what_step_by_step_did(
    path: Path, n: int | None, options: dict[str, Any], tmp_path: Path
) -> None:
    assert_same_run(path, n, options, tmp_path)


@pytest.mark.skipif(
    not FULL_TRACE.is_file(), reason=f"the public Mooncake trace is not at {FULL_TRACE}"
)
@pytest.mark.parametrize("replicas", [1, 4])
def test_the_full_mooncake_trace_replays_the_same(replicas: int, tmp_path: Path) -> None:
    options = {"capacity_blocks": 400, "block_size": 512, "replicas": replicas}
    assert_same_run(FULL_TRACE, None, options, tmp_path)


# ---- the parts the loop rests on --------------------------------------------------------------


@pytest.mark.parametrize("profile", ["datasheet", "fitted"])
def test_the_step_timer_gives_the_rooflines_floats(profile: str) -> None:
    gpu = get_gpu("h100-sxm")
    roof = Roofline.for_gpu(get_model("llama-3.1-8b"), gpu, tp=2)
    if profile == "fitted":
        roof = Roofline(
            roof.model,
            gpu,
            0.41,
            0.77,
            1.5e-3,
            2,
            attention_efficiency=0.33,
            context_attention_efficiency=0.29,
        )
    timer = roof.timer()
    rng = random.Random(7)
    for _ in range(20_000):
        tokens = rng.randint(1, 8192)
        context = rng.randint(0, 10**9)
        pairs = context + rng.randint(0, 10**8)
        read = rng.randint(0, 10**8)
        logits = rng.randint(0, 256)
        assert timer.seconds(tokens, pairs, read, logits, context) == roof.step_seconds(
            tokens, pairs, read, logits, context
        )


def test_uncached_blocks_answer_as_a_manager_with_caching_off() -> None:
    """Random admissions, forks, appends and releases: every answer (admitted or why not, an
    append taken or refused) and the free-block count equal the real manager's."""
    rng = random.Random(11)
    for block_size in (1, 4, 16):
        real = CacheManager(64, block_size, enable_caching=False)
        counted = UncachedBlocks(64, block_size)
        live: list[object] = []
        fresh: list[int] = []  # admitted, not forked or appended to yet
        for step in range(4000):
            op = rng.random()
            if op < 0.3:
                n = rng.randint(1, 200)
                tokens = np.arange(n, dtype=np.int32)
                outcome = []
                for cache in (real, counted):
                    try:
                        if cache is real:
                            real.admit(step, tokens)
                        else:
                            counted.admit(step, n)
                        outcome.append("admitted")
                    except OutOfBlocksError:
                        outcome.append("short")
                    except RequestTooLargeError:
                        outcome.append("too large")
                assert outcome[0] == outcome[1]
                if outcome[0] == "admitted":
                    live.append(step)
                    fresh.append(step)
            elif op < 0.4 and fresh:
                parent = fresh.pop(rng.randrange(len(fresh)))
                for j in range(rng.randint(1, 3)):
                    real.fork(parent, (parent, j))
                    counted.fork(parent, (parent, j))
                    live.append((parent, j))
            elif op < 0.8 and live:
                rid = rng.choice(live)
                if rid in fresh:
                    fresh.remove(rid)
                k = rng.randint(1, 40)
                try:
                    real.append(rid, np.zeros(k, dtype=np.int32))
                    took = True
                except OutOfBlocksError:
                    took = False
                assert counted.append(rid, k) is took
            elif live:
                rid = live.pop(rng.randrange(len(live)))
                if rid in fresh:
                    fresh.remove(rid)
                real.release(rid)
                counted.release(rid)
            assert counted.active_blocks() == real.block_counts().active


def test_a_refused_admission_says_how_many_blocks_it_lacks() -> None:
    """The loop reads the shortfall from the manager's refusal to know when to try again (a
    refusal that did not say would only make it try every step); so do the decode path and the
    no-cache pass."""
    mgr = CacheManager(4, 4)
    mgr.admit("a", np.arange(12, dtype=np.int32))
    with pytest.raises(OutOfBlocksError) as refused:
        mgr.admit("b", np.arange(100, 110, dtype=np.int32))
    err = refused.value
    assert (err.needed, err.available, err.shortfall) == (3, 1, 2)
    mgr.append("a", np.arange(4, dtype=np.int32))  # the last free block
    with pytest.raises(OutOfBlocksError) as refused:
        mgr.append("a", np.arange(8, dtype=np.int32))
    assert (refused.value.needed, refused.value.available) == (2, 0)
    uncached = UncachedBlocks(4, 4)
    uncached.admit("a", 12)
    with pytest.raises(OutOfBlocksError) as refused:
        uncached.admit("b", 10)
    assert refused.value.shortfall == 2


@pytest.mark.parametrize("host", [True, False])
def test_a_fleet_with_two_versions_of_an_adapter_replays_the_same(
    host: bool, tmp_path: Path
) -> None:
    """KV events name an adapter, not its version: the index files every chain under the version
    the fleet pins (the first a request named), so blocks of another version land under the
    pinned one's digests, as the service would see them. Chains under either version, salted and
    not, on a fleet whose index takes the replicas' events directly: with host offloads (the fed
    index from the start), and without (the replicas' trees answer until the second version
    comes, half-way: the fed index takes over from them)."""
    rng = random.Random(5)
    system = [rng.randrange(1, 30_000) for _ in range(700)]
    lines = []
    for k in range(160):
        record: dict[str, Any] = {
            "token_ids": system[: rng.choice((300, 500, 700))]
            + [rng.randrange(1, 30_000) for _ in range(rng.randrange(8, 90))],
            "arrival_s": k * 0.05,
            "output_length": rng.randrange(1, 40),
            "model": "llama-3.1-8b",
        }
        if k % 4:
            record["adapter"] = "sql"
            record["adapter_version"] = rng.choice(("v1", "v2")) if k >= 80 else "v1"
        if k % 3 == 0:
            record["salt"] = rng.choice(("a", "b"))
        lines.append(json.dumps(record))
    trace = tmp_path / "versions.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    options: dict[str, Any] = {"capacity_blocks": 120, "replicas": 2}
    if host:
        options["host_memory"] = GIB
    assert_same_run(trace, None, options, tmp_path)
