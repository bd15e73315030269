"""Serving replay: continuous batching over the real manager, timing, preemption, invariants."""

from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

from prefixcache import CacheManager, Namespace
from prefixcache.replay import ReplayConfig, Request, open_source, replay_path, replay_requests
from prefixcache.replay.model_specs import get_gpu
from prefixcache.replay.runner import replay_source
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.sequential import run_sequential
from prefixcache.replay.sim.serving import Simulator
from prefixcache.replay.workload.sources import Source


def scenario(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(body))
    return path


CHAT = """\
    seed: 21
    requests: 150
    arrivals: {process: poisson, rate: 40}
    prompt:
      - shared: {length: 600}
      - unique: {length: {dist: uniform, low: 20, high: 200}}
    session:
      turns: 3
      think_time_s: 0.5
      turn: [{unique: {length: 30}}]
    output: {dist: uniform, low: 1, high: 60}
    n: 1
"""


def simulate(path: Path, blocks: int, **options: object) -> tuple[Simulator, CacheManager]:
    cfg = ReplayConfig(capacity_blocks=blocks, mode="serving", **options)  # type: ignore[arg-type]
    resolved = cfg.resolve()
    mgr = CacheManager(blocks, cfg.block_size)
    acc = Accountant(cfg.block_size, mgr.hasher, track_isolation=False)
    sim = Simulator(mgr, resolved, acc)
    sim.run(open_source(path, cfg))
    return sim, mgr


@pytest.mark.parametrize("blocks", [5000, 160])
def test_every_request_finishes_and_every_block_comes_back(tmp_path: Path, blocks: int) -> None:
    sim, mgr = simulate(scenario(tmp_path, CHAT), blocks, token_budget=512)
    assert not sim.running and not sim.waiting
    assert len(sim.ttft) == 150 and not any(math.isnan(x) for x in sim.ttft)
    assert min(sim.ttft) > 0
    assert mgr.block_counts().active == 0
    mgr.check_integrity()
    if blocks == 160:
        assert sim.preemptions > 0  # too small for the batch: decode ran out of blocks


def test_cache_hits_shorten_time_to_first_token(tmp_path: Path) -> None:
    report = replay_path(
        scenario(tmp_path, CHAT),
        ReplayConfig(capacity_blocks=5000, mode="serving", token_budget=1024),
    ).to_report_dict()
    s = report["serving"]
    assert report["token_hit_rate"] > 0.5
    assert s["ttft_p50_s"] < s["ttft_nocache_p50_s"]
    assert s["steps"] > 0 and s["simulated_seconds"] > 0
    assert report["savings"]["sharing_factor"] > 1  # concurrent requests share the prompt
    assert report["savings"]["flops_saved_estimate"] > 2 * 8e9 * report["hit_tokens"]
    assert report["config"]["model"] == "llama-3.1-8b"  # the serving default


def test_sessions_reuse_decoded_output(tmp_path: Path) -> None:
    """A later turn contains the previous answer: decode committed its blocks, so it hits."""
    p = 16
    a = np.arange(100, 164, dtype=np.int32)  # 4 blocks
    out = np.arange(500, 548, dtype=np.int32)  # 48 output tokens
    follow = np.concatenate([a, out, np.arange(900, 910, dtype=np.int32)])
    ns = Namespace()
    reqs = [Request(0.0, a, len(out), ns, 1, out), Request(100.0, follow, 4, ns)]
    result = replay_source(
        Source.from_requests(reqs), ReplayConfig(capacity_blocks=100, block_size=p, mode="serving")
    )
    log = result.acc.log
    assert log is not None
    # 64 prompt tokens and 47 written outputs are cached: 111 tokens, 6 full blocks
    assert log.column("hit_tokens").tolist() == [0, 6 * p]
    assert result.to_report_dict()["upper_bound_token_hit_rate"] == 6 * p / (64 + 122)


def test_parallel_samples_in_serving_mode(tmp_path: Path) -> None:
    body = """\
        seed: 22
        requests: 150
        arrivals: {process: poisson, rate: 40}
        prompt: [{shared: {length: 300}}, {unique: {length: 45}}]
        output: 20
        n: 3
    """
    report = replay_path(
        scenario(tmp_path, body), ReplayConfig(capacity_blocks=3000, mode="serving")
    ).to_report_dict()
    assert report["cow_copies"] > 0
    assert report["output_tokens"] == 150 * 3 * 20


def test_no_cache_run_is_the_baseline(tmp_path: Path) -> None:
    sim, _ = simulate(scenario(tmp_path, CHAT), 5000)
    cfg = ReplayConfig(capacity_blocks=5000, mode="serving").resolve()
    plain = CacheManager(5000, 16, enable_caching=False)
    base = Simulator(plain, cfg, None)
    base.run(open_source(scenario(tmp_path, CHAT)))
    assert plain.stats.hit_tokens == 0
    assert sum(base.ttft) > sum(sim.ttft)


SHIPPED = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.y*ml")) + sorted(
    (Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml")
)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_scenarios_replay_in_both_modes(path: Path) -> None:
    reqs = list(itertools.islice(open_source(path), 120))
    for mode in ("sequential", "serving"):
        cfg = ReplayConfig(capacity_blocks=6000, mode=mode)
        mgr = CacheManager(6000, 16)
        acc = Accountant(16, mgr.hasher, track_isolation=len({r.namespace for r in reqs}) > 1)
        if mode == "serving":
            Simulator(mgr, cfg.resolve(), acc).run(reqs)
        else:
            run_sequential(reqs, mgr, acc)
        tot = acc.totals
        assert tot.requests == 120
        assert (
            tot.cold + tot.capacity + tot.isolation + tot.tail == tot.prompt_tokens - tot.hit_tokens
        )
        assert tot.hit_tokens <= tot.ub_tokens
        assert mgr.block_counts().active == 0
        mgr.check_integrity()


@pytest.mark.parametrize("token_budget", [8192, 256])
def test_ttft_of_a_lone_request_is_the_roofline_prefill_time(
    tmp_path: Path, token_budget: int
) -> None:
    """One 1,000-token request on an empty cache: its TTFT is the prefill time, computed here
    from the model's and the GPU's numbers (in chunks of the token budget)."""
    model = tmp_path / "tiny.json"
    model.write_text(
        '{"params": 1000000000, "num_layers": 10, "num_attention_heads": 8, '
        '"num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}'
    )
    gpu = get_gpu("h100-sxm")
    prompt = 1000
    flops_per_token = 2 * 1_000_000_000  # through the weights
    flops_per_pair = 4 * 10 * 8 * 64  # QK and AV, every layer and query head
    weight_bytes = 1_000_000_000 * 2
    kv_bytes_per_token = 2 * 10 * 2 * 64 * 2  # K and V, every layer and KV head, bf16
    expected, done = 0.0, 0
    while done < prompt:
        chunk = min(token_budget, prompt - done)
        pairs = chunk * done + chunk * (chunk + 1) // 2  # causal, after ``done`` tokens
        compute = (flops_per_token * chunk + flops_per_pair * pairs) / (0.5 * gpu.peak_flops)
        memory = (weight_bytes + kv_bytes_per_token * (done + chunk)) / (0.8 * gpu.hbm_bytes_per_s)
        expected += max(compute, memory) + 0.002
        done += chunk
    tokens = np.arange(prompt, dtype="<i4")
    config = ReplayConfig(
        capacity_blocks=200,
        mode="serving",
        model=str(model),
        gpu="h100-sxm",
        token_budget=token_budget,
    )
    serving = replay_requests([Request(0.0, tokens, 4, Namespace())], config).serving
    assert serving is not None
    assert serving.ttft == [pytest.approx(expected, rel=1e-12)]
    assert serving.ttft_nocache == serving.ttft
