"""Fleet replay: replicas behind the router, fed through the KV event wire."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import yaml
from fleet_support import manager_digests

from prefixcache.cli import main
from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.runner import replay_source
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.fleet.replica_trees import ReplicaTrees
from prefixcache.replay.sim.fleet.simulator import FleetSimulator
from prefixcache.run_format import MISS_CAUSES

SCENARIO = Path(__file__).parents[2] / "scenarios" / "shared_system_prompt.yaml"
BLOCKS = 300  # per replica: the system prompt (64 blocks) and a few questions


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped scenario, cut to a few hundred requests."""
    spec = yaml.safe_load(SCENARIO.read_text())
    spec["requests"] = 240
    path = tmp_path_factory.mktemp("fleet") / "shared.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def config(replicas: int, routing: str | None) -> ReplayConfig:
    return ReplayConfig(
        capacity_blocks=BLOCKS, mode="serving", replicas=replicas, routing=routing, max_seqs=32
    )


@cache
def _report(path: str, replicas: int, routing: str | None) -> dict:
    cfg = config(replicas, routing)
    return replay_source(open_source(path, cfg), cfg).to_report_dict()


def report(path: Path, replicas: int, routing: str | None) -> dict:
    return _report(str(path), replicas, routing)


def test_prefix_routing_beats_round_robin(small: Path) -> None:
    rr = report(small, 4, "round_robin")
    pre = report(small, 4, "prefix")
    assert pre["token_hit_rate"] > rr["token_hit_rate"]


def test_routing_misses_only_with_several_replicas(small: Path) -> None:
    assert report(small, 1, "round_robin")["misses"]["routing"] == 0
    assert report(small, 4, "round_robin")["misses"]["routing"] > 0


@pytest.mark.parametrize(
    ("replicas", "routing"), [(1, "prefix"), (4, "round_robin"), (4, "prefix")]
)
def test_miss_breakdown_sums_exactly(small: Path, replicas: int, routing: str) -> None:
    r = report(small, replicas, routing)
    assert set(r["misses"]) == set(MISS_CAUSES)
    assert sum(r["misses"].values()) == r["prompt_tokens"] - r["hit_tokens"]
    assert all(v >= 0 for v in r["misses"].values())


def test_attribution_columns_are_the_replays_own_view(small: Path) -> None:
    """Available is what any replica held (hits plus routing misses), captured what the chosen
    one held, delivered equals captured: a replay's engine delivers what its cache holds."""
    r = report(small, 4, "round_robin")
    a = r["fleet"]["attribution"]
    assert a["prompt_tokens"] == r["prompt_tokens"]
    assert a["captured_tokens"] == a["delivered_tokens"] == r["hit_tokens"]
    assert a["available_tokens"] - a["captured_tokens"] == r["misses"]["routing"] > 0


def test_pooled_line_bounds_every_policy(small: Path) -> None:
    for routing in ("round_robin", "prefix", "prefix_balanced"):
        r = report(small, 4, routing)
        pooled = r["fleet"]["pooled"]
        assert pooled["capacity_blocks"] == 4 * BLOCKS
        assert pooled["token_hit_rate"] >= r["token_hit_rate"]


def test_per_replica_figures_add_up(small: Path) -> None:
    r = report(small, 4, "round_robin")
    reps = r["fleet"]["per_replica"]
    assert len(reps) == 4
    assert sum(x["requests"] for x in reps) == r["requests"]
    assert sum(x["hit_tokens"] for x in reps) == r["hit_tokens"]
    assert {x["requests"] for x in reps} == {60}  # round robin: even
    assert r["fleet"]["request_imbalance"] == 1.0
    assert r["fleet"]["load_imbalance"] >= 1.0


def test_one_replica_fleet_matches_the_single_cache(small: Path) -> None:
    """A fleet of one routes everything to one cache: the same hits as the plain replay."""
    plain_cfg = ReplayConfig(capacity_blocks=BLOCKS, mode="serving", max_seqs=32)
    plain = replay_source(open_source(small, plain_cfg), plain_cfg).to_report_dict()
    fleet = report(small, 1, "prefix")
    for key in ("hit_tokens", "prompt_tokens", "misses", "evicted_blocks"):
        assert fleet[key] == plain[key]
    assert fleet["serving"]["ttft_p50_s"] == plain["serving"]["ttft_p50_s"]
    busy = fleet["fleet"]["per_replica"][0]["busy_seconds"]
    assert busy == pytest.approx(plain["serving"]["load"]["busy_s"])  # counted once
    assert "fleet" not in plain and "replicas" not in plain["config"]
    # the serving benchmark's figures, the offered load and the model's assumptions too
    for key in ("benchmark", "load", "assumptions"):
        assert fleet["serving"][key] == plain["serving"][key], key


def test_a_fleet_reports_benchmark_figures_and_the_busiest_replicas_load(small: Path) -> None:
    r = report(small, 3, "round_robin")
    sv, per_replica = r["serving"], r["fleet"]["per_replica"]
    busy = [p["busy_seconds"] for p in per_replica]
    bench = sv["benchmark"]
    assert bench["with_cache"]["completed"] == bench["without_cache"]["completed"] == 240
    assert bench["with_cache"]["busy_s"] == pytest.approx(sum(busy))
    assert bench["with_cache"]["ttft_p50_s"] == pytest.approx(sv["ttft_p50_s"])
    load = sv["load"]
    assert load["replicas"] == 3 and load["busiest_replica_busy_s"] == pytest.approx(max(busy))
    span = load["arrival_span_s"]
    assert load["offered_load"] == pytest.approx(sum(busy) / (3 * span))
    assert load["offered_load_busiest"] == pytest.approx(max(busy) / span)
    assert sv["assumptions"]["gpu"]


def test_fleet_overload_is_decided_by_the_busiest_replica() -> None:
    from prefixcache.replay.sim.serving_figures import OfferedLoad
    from prefixcache.report.run_warnings import overload_warning

    # two replicas, one doing all the work: fine on average, overloaded where it runs
    load = OfferedLoad(100.0, 150.0, 150.0, 1.0, replicas=2, busiest_s=150.0)
    assert load.offered_load == pytest.approx(0.75) and load.overloaded
    assert load.sustainable_rate_scale == pytest.approx(1 / 1.5)
    warning = overload_warning({"load": load.report_dict()})
    assert warning is not None and "the busiest replica needs 150 s" in warning
    assert not OfferedLoad(100.0, 150.0, 150.0, 1.0, replicas=2, busiest_s=80.0).overloaded


def test_index_equals_the_replicas_cached_blocks(small: Path) -> None:
    """The fed index, kept by the replicas' events alone from the start, holds what they do."""
    cfg = config(3, "prefix_balanced")
    resolved = cfg.resolve()
    source = open_source(small, cfg)
    first = next(iter(source))
    sim = FleetSimulator(resolved, None, first.namespace)
    assert not sim.index.filed  # lean replicas: their trees answer
    sim.feed_index()
    sim.run(source)
    assert sim.router.in_flight() == 0
    for rep in sim.replicas:
        held = set(sim.index.fed.holdings(rep.name))
        assert held == manager_digests(rep.mgr)
        assert held  # something was cached


class _BothIndexes:
    """What the router reads, from the replicas' trees, checked against the index their events
    keep at every read."""

    def __init__(self, trees: ReplicaTrees) -> None:
        self.trees = trees
        self.reads = 0

    def match(self, digests: list[bytes]) -> list[ReplicaMatch]:
        got = self.trees.match(digests)
        if not self.trees.filed:
            fed = {m.replica: m for m in self.trees.fed.match(digests)}
            for m in got:
                assert m == fed.get(m.replica, ReplicaMatch(m.replica, 0, 0))
            self.reads += 1
        return got

    def num_blocks_many(self, replicas: list[str], medium: str | None = None) -> dict[str, int]:
        got = self.trees.num_blocks_many(replicas, medium)
        if not self.trees.filed:
            assert got == self.trees.fed.num_blocks_many(replicas, medium)
        return got


@pytest.mark.parametrize("name", ["shared_system_prompt.yaml", "multi_tenant.yaml"])
def test_the_trees_answer_as_the_fed_index_would(name: str, tmp_path: Path) -> None:
    """While the replicas are lean, every route reads from their trees what the index their
    events keep would answer (the feeds run beside the trees here to compare)."""
    path = _cut(name, tmp_path)
    cfg = config(3, "prefix")
    source = open_source(path, cfg)
    sim = FleetSimulator(cfg.resolve(), None, next(iter(source)).namespace)
    for rep in sim.replicas:  # the fed index kept beside the trees, which still answer
        rep.start_feed()
    both = _BothIndexes(sim.index)
    sim.router._index = both  # type: ignore[assignment]
    sim.run(source)
    assert both.reads > 200 and not sim.index.filed
    for rep in sim.replicas:
        assert set(sim.index.fed.holdings(rep.name)) == manager_digests(rep.mgr)
        assert sim.index.num_blocks(rep.name) == sim.index.fed.num_blocks(rep.name)
    assert sum(sim.index.num_blocks(r.name) for r in sim.replicas) > 0


def test_accountant_routing_cause_is_carved_from_capacity() -> None:
    """A prompt seen before, missed here, held elsewhere: its blocks are routing misses."""
    import numpy as np

    from prefixcache import CacheManager, Namespace
    from prefixcache.replay import Request

    mgr = CacheManager(16, 4)
    acc = Accountant(4, mgr.hasher, track_isolation=False)
    req = Request(0.0, np.arange(10, dtype=np.int32), 1, Namespace("m"))
    acc.record(0, req, req.tokens.tobytes(), 0, False, 0)
    acc.record(1, req, req.tokens.tobytes(), 0, False, 0, elsewhere=1)
    t = acc.totals
    assert (t.cold, t.capacity, t.routing, t.tail) == (8, 4, 4, 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "positive replica counts"),
        (["--replicas", "two"], "replica counts"),
        (["--routing", "random"], "unknown routing policy 'random'"),
        (["--routing", "prefix,bogus"], "unknown routing policy 'bogus'"),
    ],
)
def test_bad_fleet_flags_exit_2_with_one_line(
    small: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(small), "--mode", "serving", "--blocks", "100", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_fleet_needs_serving_mode(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(small), "--blocks", "100", "--replicas", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefixcache replay: error: --replicas and --routing need --mode serving"]


def test_fleet_report_is_valid(small: Path) -> None:
    from prefixcache.report.run_dir import schema_problems

    assert schema_problems(report(small, 4, "prefix")) == []


def test_cli_sweeps_replicas_and_policies(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["replay", str(small), "--mode", "serving", "--blocks", str(BLOCKS), "--max-seqs", "32"]
    argv += [
        "--replicas",
        "1,2",
        "--routing",
        "round_robin,prefix",
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "pooled cache" in text and "routing miss" in text

    rows = json.loads((out / "report.json").read_text())["sweep"]
    assert [(r["replicas"], r["routing"]) for r in rows] == [
        (1, "round_robin"),
        (1, "prefix"),
        (2, "round_robin"),
        (2, "prefix"),
    ]
    assert all(r["pooled_token_hit_rate"] >= r["token_hit_rate"] for r in rows)


def test_fleet_run_passes_its_consistency_checks(small: Path, tmp_path: Path) -> None:
    """The fleet timeline adds up every replica's blocks: it is checked against the fleet's
    total capacity, not one replica's."""
    from prefixcache.report import load_run
    from prefixcache.report.checks import consistency_checks

    out = tmp_path / "fleet"
    argv = ["replay", str(small), "--mode", "serving", "--blocks", str(BLOCKS)]
    assert main([*argv, "--replicas", "3", "--routing", "prefix", "--out", str(out)]) == 0
    run = load_run(out)
    failed = [c.name for c in consistency_checks(run) if not c.ok]
    assert failed == []
    # the timeline's time never goes back, and its text chart is scaled to the fleet's capacity
    times = run.timeline["t"].astype(float)
    assert len(times) > 10 and (times[1:] >= times[:-1]).all()
    from prefixcache.report import build_document
    from prefixcache.report.render.text_formats import render_terminal

    assert f"0–{3 * BLOCKS}" in render_terminal(build_document(run))


def _cut(name: str, tmp: Path) -> Path:
    """A shipped multi-namespace scenario, cut to a few hundred requests."""
    src = Path(__file__).parents[2] / "scenarios" / name
    if src.suffix == ".toml":
        import tomllib

        spec = tomllib.loads(src.read_text())
    else:
        spec = yaml.safe_load(src.read_text())
    spec["requests"] = 240
    path = tmp / f"{src.stem}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("name", ["multi_tenant.yaml", "lora_adapters.toml"])
def test_tenants_and_adapters_replay_on_a_fleet(name: str, tmp_path: Path) -> None:
    """Salts and adapters are per request: every replica serves them, the index keys them apart
    as the managers do, and a fleet of one still equals the single cache."""
    path = _cut(name, tmp_path)
    cfg = config(3, "prefix")
    resolved = cfg.resolve()
    source = open_source(path, cfg)
    assert source.multi_namespace
    sim = FleetSimulator(resolved, None, next(iter(source)).namespace)
    sim.feed_index()  # the index the events keep, keyed as the managers key
    sim.run(source)
    for rep in sim.replicas:
        assert set(sim.index.fed.holdings(rep.name)) == manager_digests(rep.mgr)
    plain_cfg = ReplayConfig(capacity_blocks=BLOCKS, mode="serving", max_seqs=32)
    plain = replay_source(open_source(path, plain_cfg), plain_cfg).to_report_dict()
    one = replay_source(open_source(path, config(1, "prefix")), config(1, "prefix"))
    fleet = one.to_report_dict()
    for key in ("hit_tokens", "prompt_tokens", "misses"):
        assert fleet[key] == plain[key]
    assert plain["misses"]["isolation"] > 0  # the namespaces really are kept apart
    many = report(path, 3, "prefix")
    assert many["hit_tokens"] > 0 and many["fleet"]["pooled"]["token_hit_rate"] > 0


def test_a_fleet_refuses_a_workload_of_several_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "two_models.jsonl"
    lines = [
        {"timestamp": 0, "model": "a", "token_ids": list(range(40))},
        {"timestamp": 1, "model": "b", "token_ids": list(range(40))},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["replay", str(trace), "--mode", "serving", "--blocks", "100", "--replicas", "2"]
    assert main([*args, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "serves one model" in err and "Traceback" not in err


def test_strict_fires_in_fleet_mode(tmp_path: Path) -> None:
    """A fleet replay whose request outgrows a replica's cache is rejected, counted and
    reported as in a single-cache replay, so --strict exits 3; without the big request it
    exits 0."""
    rows = [
        {"token_ids": list(range(k * 1000, k * 1000 + 400)), "arrival_s": k * 0.5} for k in range(6)
    ]
    big = {"token_ids": list(range(90_000, 93_000)), "arrival_s": 1.2}  # 188 blocks > 100
    fine, rejected = tmp_path / "fine.jsonl", tmp_path / "rejected.jsonl"
    fine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejected.write_text("".join(json.dumps(r) + "\n" for r in [*rows[:3], big, *rows[3:]]))
    args = ["--mode", "serving", "--blocks", "100", "--replicas", "2", "--output-len", "4"]
    args += ["--no-progress", "--strict"]
    assert main(["replay", str(fine), *args, "--out", str(tmp_path / "a")]) == 0
    assert main(["replay", str(rejected), *args, "--out", str(tmp_path / "b")]) == 3
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["rejected_requests"] == 1 and report["config"]["replicas"] == 2
    assert {"benchmark", "load", "assumptions"} <= set(report["serving"])


def test_the_over_time_section_says_a_fleets_blocks_are_all_replicas_together(
    small: Path, tmp_path: Path
) -> None:
    from prefixcache.report import build_document, load_run
    from prefixcache.report.render.text_formats import render_markdown

    out = tmp_path / "run"
    args = ["replay", str(small), "--mode", "serving", "--replicas", "2", "--blocks", str(BLOCKS)]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    md = render_markdown(build_document(load_run(out)))
    over_time = md.split("## Over time", 1)[1]
    assert (
        "A fleet: the blocks over time are the 2 replicas' together, against their total "
        "capacity; the run's cache size is one replica's (300 blocks each)." in over_time
    )
