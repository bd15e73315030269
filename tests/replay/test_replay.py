"""Sequential replay against independent, deliberately simple computations."""

from __future__ import annotations

import json
import textwrap
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheManager, Namespace
from prefixcache.replay import ReplayConfig, Request, replay_path, replay_requests
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.sequential import run_sequential

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
FULL_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def simple_mooncake(
    path: Path, block: int, capacity: int | None, trace_block: int = 512
) -> tuple[int, int, int]:
    """(prompt tokens, hit tokens, infinite-cache hit tokens) of a sequential LRU replay.

    A block is named by the hash ids up to the one holding it and its offset in that id's
    block. The cache is an OrderedDict in eviction order: after each request its whole chain is
    the most recent, deepest block first out; blocks matched by a request cannot be evicted
    while it is admitted; the prompt's partial block and the copy of a fully cached prompt's
    last block need room too. A fully cached prompt recomputes one token; a prompt larger than
    the cache is rejected.
    """
    per = trace_block // block
    cache: OrderedDict = OrderedDict()
    seen: set = set()
    total = hit = bound = 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ids, t = r["hash_ids"], r["input_length"]
        f = t // block
        chain = [(tuple(ids[: k // per + 1]), k % per) for k in range(f)]
        total += t
        u = next((k for k, key in enumerate(chain) if key not in seen), f)
        bound += t - 1 if u == f and f * block == t else u * block
        seen.update(chain)
        if capacity is None or -(-t // block) > capacity:
            continue  # a prompt larger than the whole cache is rejected and changes nothing
        n = next((k for k, key in enumerate(chain) if key not in cache), f)
        whole = n == f and f * block == t
        hit += t - 1 if whole else n * block
        need = -(-t // block) - (n - 1 if whole else n)
        for key in reversed(chain[:n]):
            cache.move_to_end(key)
        while capacity - len(cache) < need:
            cache.popitem(last=False)
        for key in chain[n:]:
            cache[key] = None
        for key in reversed(chain):
            cache.move_to_end(key)
    return total, hit, bound


def mooncake_case(path: Path, block: int, capacity: int) -> None:
    report = replay_path(
        path, ReplayConfig(capacity_blocks=capacity, block_size=block)
    ).to_report_dict()
    total, hit, bound = simple_mooncake(path, block, capacity)
    assert report["prompt_tokens"] == total
    assert report["hit_tokens"] == hit, (block, capacity)
    assert report["upper_bound_token_hit_rate"] == bound / total
    assert report["partial_copy_tokens"] == 0


@pytest.mark.skipif(not FULL_TRACE.is_file(), reason=f"Mooncake trace not found at {FULL_TRACE}")
@pytest.mark.parametrize("capacity", [1000, 5859, 10000])
def test_mooncake_trace_lru_and_infinite_cache_match_a_simple_model(capacity: int) -> None:
    mooncake_case(FULL_TRACE, 512, capacity)


@pytest.mark.skipif(not FULL_TRACE.is_file(), reason=f"Mooncake trace not found at {FULL_TRACE}")
def test_mooncake_trace_ideal_ratio() -> None:
    total, _, bound = simple_mooncake(FULL_TRACE, 512, None)
    assert bound / total == pytest.approx(0.6504, abs=5e-4)  # full blocks; block rate is ~66%


@pytest.mark.parametrize(("block", "capacity"), [(512, 300), (512, 3000), (64, 4000), (16, 30000)])
def test_mooncake_sample_matches_a_simple_model(block: int, capacity: int) -> None:
    mooncake_case(SAMPLE, block, capacity)


def shared_prompt_scenario(tmp_path: Path, requests: int, shared: int, unique: int) -> Path:
    path = tmp_path / "shared.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        seed: 11
        requests: {requests}
        arrivals: {{process: poisson, rate: 5}}
        prompt:
          - shared: {{length: {shared}}}
          - unique: {{length: {unique}}}
        output: 8
    """)
    )
    return path


@pytest.mark.parametrize(("shared", "partial_copy"), [(1000, True), (1000, False), (992, True)])
def test_n_requests_sharing_one_prompt_hit_exactly_as_expected(
    tmp_path: Path, shared: int, partial_copy: bool
) -> None:
    n, unique, p = 200, 37, 16
    path = shared_prompt_scenario(tmp_path, n, shared, unique)
    report = replay_path(
        path, ReplayConfig(capacity_blocks=10_000, block_size=p, partial_copy=partial_copy)
    ).to_report_dict()
    t = shared + unique
    per_hit = shared if partial_copy else shared // p * p
    assert report["requests"] == n and report["prompt_tokens"] == n * t
    assert report["hit_tokens"] == (n - 1) * per_hit
    assert report["hit_blocks"] == (n - 1) * (shared // p)
    assert report["upper_bound_block_hit_rate"] == report["block_hit_rate"]
    assert report["zero_hit_requests"] == 1
    misses = report["misses"]
    assert misses["capacity"] == misses["isolation"] == misses["routing"] == 0
    assert misses["tail"] == n * (t % p)
    assert sum(misses.values()) == report["prompt_tokens"] - report["hit_tokens"]
    assert report["partial_copy_tokens"] == ((n - 1) * (shared % p) if partial_copy else 0)
    assert report["top_prefixes"][0]["requests"] == n - 1
    assert report["top_prefixes"][0]["depth_blocks"] == shared // p


def test_miss_causes_cold_capacity_isolation_tail() -> None:
    p = 4
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, 18, dtype=np.int32)  # 4 full blocks and a 2-token tail
    y = rng.integers(1000, 2000, 40, dtype=np.int32)  # 10 blocks, evicts x from a 10-block cache
    a, b = Namespace(salt="a"), Namespace(salt="b")
    reqs = [
        Request(0.0, x, 1, a),
        Request(1.0, x, 1, b),
        Request(2.0, y, 1, a),
        Request(3.0, x, 1, a),
        Request(4.0, x[:16], 1, a),
    ]
    result = replay_requests(reqs, ReplayConfig(capacity_blocks=10, block_size=p))
    log = result.acc.log
    assert log is not None
    rows = list(
        zip(
            *(
                log.column(c).astype(int).tolist()
                for c in ("hit_tokens", "miss_cold", "miss_capacity", "miss_isolation", "miss_tail")
            ),
            strict=True,
        )
    )
    assert rows[0] == (0, 16, 0, 0, 2)  # never seen
    assert rows[1] == (0, 0, 0, 16, 2)  # the same tokens under tenant a only
    assert rows[2] == (0, 40, 0, 0, 0)
    assert rows[3] == (0, 0, 16, 0, 2)  # seen in this namespace, evicted since
    assert rows[4] == (15, 0, 0, 0, 1)  # fully cached: only the last token is computed
    report = result.to_report_dict()
    assert report["cow_copies"] == 1 and report["evicted_blocks"] > 0
    assert report["namespaces"] == ["default salt=a", "default salt=b"]


def test_parallel_samples_fork_and_copy_the_shared_last_block() -> None:
    p, n = 16, 4
    reqs = [
        Request(float(i), np.arange(i * 1000, i * 1000 + 40, dtype=np.int32), 5, Namespace(), n)
        for i in range(3)
    ]
    mgr = CacheManager(200, p)
    acc = Accountant(p, mgr.hasher, track_isolation=False)
    run_sequential(reqs, mgr, acc)
    assert mgr.stats.forks == 3 * (n - 1)
    assert mgr.stats.cow_copies == 3 * (n - 1)  # every writer but the last copies the block
    assert mgr.block_counts().active == 0
    mgr.check_integrity()
    assert acc.logical_peak == n * 3  # 44 tokens per sample: 3 blocks each
    assert acc.physical_peak == 2 + n  # 2 shared full blocks, one last block per sample
    assert acc.totals.output_tokens == 3 * n * 5


@st.composite
def workloads(draw: st.DrawFn) -> list[Request]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    prefixes = [rng.integers(0, 50, int(rng.integers(1, 30)), dtype=np.int32) for _ in range(4)]
    spaces = [Namespace(salt="x"), Namespace(salt="y")]
    reqs = []
    for i in range(draw(st.integers(1, 40))):
        parts = [prefixes[j] for j in rng.choice(4, int(rng.integers(0, 3)))]
        parts.append(rng.integers(0, 50, int(rng.integers(1, 20)), dtype=np.int32))
        tokens = np.concatenate(parts)
        reqs.append(Request(float(i), tokens, 0, spaces[int(rng.integers(0, 2))]))
    return reqs


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(1, 60), st.sampled_from([2, 4, 8]), st.booleans())
def test_any_workload_accounts_every_token(
    reqs: list[Request], capacity: int, p: int, partial: bool
) -> None:
    capacity = max(capacity, max(-(-len(r.tokens) // p) for r in reqs))
    result = replay_requests(
        reqs, ReplayConfig(capacity_blocks=capacity, block_size=p, partial_copy=partial)
    )
    report = result.to_report_dict()
    log = result.acc.log
    assert log is not None
    cold, capacity, isolation, tail, prompt, hit = (
        log.column(c)
        for c in (
            "miss_cold",
            "miss_capacity",
            "miss_isolation",
            "miss_tail",
            "prompt_tokens",
            "hit_tokens",
        )
    )
    assert len(prompt) == len(log) == len(reqs)
    assert np.array_equal(cold + capacity + isolation + tail, prompt - hit)
    assert min(cold.min(), capacity.min(), isolation.min()) >= 0
    assert report["hit_tokens"] == result.stats.hit_tokens
    assert report["token_hit_rate"] <= report["upper_bound_token_hit_rate"]
    # the infinite cache, by brute force over token tuples
    seen: set = set()
    bound = 0
    for r in reqs:
        keys = [
            (r.namespace, tuple(r.tokens[: (k + 1) * p].tolist()))
            for k in range(len(r.tokens) // p)
        ]
        u = next((k for k, key in enumerate(keys) if key not in seen), len(keys))
        bound += len(r.tokens) - 1 if u == len(keys) and u * p == len(r.tokens) else u * p
        seen.update(keys)
    if not partial:
        assert result.acc.totals.ub_tokens == bound
        big = replay_requests(
            reqs, ReplayConfig(capacity_blocks=10_000, block_size=p, partial_copy=False)
        )
        assert big.acc.totals.hit_tokens == bound  # an infinite cache reaches the bound
