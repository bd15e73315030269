"""The pool's write policies: ``evict`` pools the blocks a replica evicts, ``through`` every full
prompt block as soon as a replica computes it.

The replay's tier admissions (managers of several replicas sharing one pool, admitted then
released one request at a time) are pinned against an independent model: per replica an LRU of
the blocks on the GPU, and one LRU of block keys shared by all of them.

The model's rules:

* a GPU hit is the longest chain of the prompt's full blocks on the replica's GPU (prompts here
  never end on a block boundary, so the whole prompt is never a hit);
* the chain then continues in the pool up to block ``(t - 1) // p``; the blocks found are loaded
  (moving a 512-token block of an 8B model beats recomputing it) and become the pool's most
  recent, first block of the chain first;
* the prompt needs ``ceil(t / p)`` blocks less its GPU hits; the GPU evicts its least recently
  released blocks to make room (a released request's blocks are used deepest first, so a block
  is never older than its child and plain LRU evicts leaves only), never a block of the match;
* ``evict``: every block the GPU evicts goes to the pool, least recent first; ``through``: the
  prompt's full blocks past the GPU and pool hits go to the pool, in chain order; a pool put of
  a pooled block refreshes it, and a full pool drops its least recent block.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError
from prefixcache.replay import ReplayConfig
from prefixcache.replay.runner import replay_requests
from prefixcache.replay.tiers.admission import build_tiers
from prefixcache.replay.workload.request import Request

MODEL = "llama-3.1-8b"
P = 512
BPB = 2 * 32 * 8 * 128 * 2 * P  # llama-3.1-8b: K and V of 512 tokens, every layer
NS = Namespace(MODEL)
SAMPLE = Path(__file__).resolve().parents[2] / "scenarios" / "traces" / "mooncake_sample.jsonl"


class PoolModel:
    """Replicas' GPU LRUs over one shared pool LRU."""

    def __init__(self, replicas: int, gpu_blocks: int, pool_blocks: int, write: str) -> None:
        self.gpus: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self.c, self.pool_blocks, self.write = gpu_blocks, pool_blocks, write
        self.pool: OrderedDict[bytes, None] = OrderedDict()

    def _put(self, d: bytes) -> None:
        if d in self.pool:
            self.pool.move_to_end(d)
            return
        self.pool[d] = None
        if len(self.pool) > self.pool_blocks:
            self.pool.popitem(last=False)

    def request(self, replica: int, digests: list[bytes], t: int) -> int:
        """Admit and release one prompt of ``t`` tokens; returns its pool hit blocks."""
        gpu, f = self.gpus[replica], len(digests)
        n = 0
        while n < f and digests[n] in gpu:
            n += 1
        held = set(digests[:n])
        need = -(-t // P) - n
        evicted = []
        while need > self.c - len(gpu):
            victim = next(d for d in gpu if d not in held)
            del gpu[victim]
            evicted.append(victim)
        if self.write == "evict":
            for d in evicted:
                self._put(d)
        k = 0
        while n + k < (t - 1) // P and digests[n + k] in self.pool:
            k += 1
        for d in digests[n : n + k]:
            self.pool.move_to_end(d)
        if self.write == "through":
            for d in digests[n + k :]:
                self._put(d)
        for d in reversed(digests):  # released: the deepest block is the least recent
            gpu[d] = None
            gpu.move_to_end(d)
        return k


def _prompts(seed: int, count: int, chains: list[list[int]]) -> list[np.ndarray]:
    """``count`` prompts: a chain of full blocks drawn (skewed) from ``chains``, then a tail
    shorter than a block."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chain = chains[min(int(rng.expovariate(0.15)), len(chains) - 1)]
        blocks = [np.full(P, key, dtype="<i4") for key in chain]
        tail = np.array([rng.randrange(1, 50_000) for _ in range(rng.randrange(1, P))], "<i4")
        out.append(np.ascontiguousarray(np.concatenate([*blocks, tail]), dtype="<i4"))
    return out


def _pool_hits(
    prompts: list[np.ndarray], route: list[int], gpu_blocks: int, pool_blocks: int, write: str
) -> tuple[int, int]:
    """(the replay's pool hit blocks, the model's) over the same requests and routes."""
    replicas = max(route) + 1
    resolved = ReplayConfig(
        capacity_blocks=gpu_blocks,
        model=MODEL,
        block_size=P,
        partial_copy=False,
        pool_memory=pool_blocks * BPB,
        pool_write=write,
        record=False,
    ).resolve()
    assert resolved.tiers is not None and resolved.tiers.pool_blocks == pool_blocks
    managers = [resolved.cache_manager() for _ in range(replicas)]
    tiers = build_tiers(resolved, managers)
    assert tiers is not None
    model = PoolModel(replicas, gpu_blocks, pool_blocks, write)
    hasher = BlockHasher(P)
    replayed = modelled = 0
    for i, (tokens, k) in enumerate(zip(prompts, route, strict=True)):
        admitter, mgr = tiers.admitters[k], managers[k]
        adm = admitter.admit(i, tokens, NS)
        hit = admitter.split(bytes(mgr.internals.states[i].tokens), NS, adm)
        mgr.release(i)
        replayed += hit.pool_blocks
        modelled += model.request(k, hasher.hash_prompt(tokens, NS), len(tokens))
    return replayed, modelled


@pytest.mark.parametrize("write", ["evict", "through"])
@pytest.mark.parametrize("pool_blocks", [3, 10, 200])
def test_pool_hits_match_the_model_with_gpu_evictions(write: str, pool_blocks: int) -> None:
    """One full block per prompt and 6 GPU blocks per replica: the GPUs evict all the time."""
    prompts = _prompts(1, 600, [[key] for key in range(1, 41)])
    rng = random.Random(2)
    route = [rng.randrange(3) for _ in prompts]
    replayed, modelled = _pool_hits(prompts, route, 6, pool_blocks, write)
    assert modelled > 0
    assert replayed == modelled


@pytest.mark.parametrize("write", ["evict", "through"])
@pytest.mark.parametrize("pool_blocks", [4, 15, 400])
def test_pool_hits_match_the_model_for_shared_chains(write: str, pool_blocks: int) -> None:
    """Chains of 2 to 4 blocks sharing prefixes, GPUs that never evict: the evict policy pools
    nothing, write-through pools every computed block for the other replicas."""
    chains = [[s, s + 1, *doc] for s in (100, 200, 300) for doc in ([1], [2, 3], [4], [5, 6])]
    prompts = _prompts(3, 300, chains)
    rng = random.Random(4)
    route = [rng.randrange(4) for _ in prompts]
    replayed, modelled = _pool_hits(prompts, route, 10_000, pool_blocks, write)
    assert (modelled > 0) == (write == "through")
    assert replayed == modelled


def _fleet_pool_hits(write: str) -> dict:
    """Two requests with one prompt, routed round robin to two replicas that never evict: the
    second arrives after the first has finished, its replica still holding every block."""
    rng = np.random.default_rng(5)
    prompt = np.ascontiguousarray(rng.integers(1, 50_000, 4 * P + 100), dtype="<i4")
    requests = [Request(0.0, prompt, 8, NS), Request(10.0, prompt, 8, NS)]
    config = ReplayConfig(
        capacity_blocks=1000,
        mode="serving",
        model=MODEL,
        block_size=P,
        replicas=2,
        routing="round_robin",
        pool_memory=100 * BPB,
        pool_write=write,
    )
    report = replay_requests(requests, config).to_report_dict()
    assert [r["requests"] for r in report["fleet"]["per_replica"]] == [1, 1]
    assert report["fleet"]["per_replica"][0]["evicted_blocks"] == 0
    return report


def test_a_replica_hits_a_block_another_computed_and_holds_only_under_write_through() -> None:
    through = _fleet_pool_hits("through")
    assert through["tiers"]["pool_hit_tokens"] == 4 * P  # every full block, from replica 0
    assert through["fleet"]["per_replica"][1]["hit_tokens"] == 4 * P
    assert through["tiers"]["pool"]["written_blocks"] == 4  # replica 1 loaded, wrote nothing
    assert through["config"]["tiers"]["pool_write"] == "through"
    assert through["tiers"]["pool"]["write"] == "through"
    evict = _fleet_pool_hits("evict")
    assert evict["tiers"]["pool_hit_tokens"] == 0 and evict["hit_tokens"] == 0
    assert evict["tiers"]["pool"]["written_blocks"] == 0
    assert evict["config"]["tiers"]["pool_write"] == "evict"


def test_pool_write_is_checked() -> None:
    base = ReplayConfig(capacity_blocks=100, model=MODEL, pool_memory=64 * BPB)
    with pytest.raises(ConfigError, match="pool write policy"):
        base.with_(pool_write="back").resolve()
    with pytest.raises(ConfigError, match="needs --pool-memory"):
        base.with_(pool_memory=None, pool_write="through").resolve()
    assert base.resolve().tiers.pool_write == "evict"  # type: ignore[union-attr]


def test_cli_pool_write_reaches_the_report(tmp_path: Path) -> None:
    from prefixcache.report import build_document, load_run, render_markdown

    out = tmp_path / "run"
    done = _cli(
        "--blocks", "200", "--model", MODEL, "--pool-memory", "64GiB", "--pool-write", "through",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["tiers"]["pool_write"] == "through"
    pool = report["tiers"]["pool"]
    assert pool["write"] == "through" and pool["written_blocks"] >= pool["stored_blocks"] > 0
    assert pool["write_seconds"] == pytest.approx(
        pool["written_blocks"] * report["config"]["bytes_per_block"] / 25e9
    )
    text = render_markdown(build_document(load_run(out)))
    assert "written through as computed" in text and "Blocks written to the shared pool" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pool-write", "through", "--host-memory", "1GiB"], "--pool-write needs --pool-memory"),
        (["--pool-write", "back", "--pool-memory", "1GiB"], "invalid choice: 'back'"),
    ],
)
def test_cli_pool_write_errors(args: list[str], message: str, tmp_path: Path) -> None:
    done = _cli("--blocks", "100", "--model", MODEL, *args, "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", "replay", str(SAMPLE), *args],
        capture_output=True,
        text=True,
    )
