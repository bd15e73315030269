"""Replay speed: sequential layers on the Mooncake trace and a 1,000,000-request scenario, and
the serving and fleet replays a planner runs, against the sequential replay of the same workload.

    python bench/replay_speed.py [--only sequential|planner] [--requests 1000000] [--trace PATH]
                                 [--repeats 1] [--baseline TREE]

Sequential: for each workload, three layers, so the cost of each is visible:
  source   reading / generating the requests alone (token arrays included)
  manager  source + CacheManager.admit/release, nothing else (the floor for any replay)
  replay   the full sequential replay: source, manager and hit accounting (shadow upper bound,
           miss causes, per-request rows)
Prints requests/s, requests/min, microseconds per request and per prompt block.

Planner: the multi-turn chat scenario (20,000 requests, llama-3.1-8b, 4 GiB of KV) replayed
sequentially, in serving mode on one replica and on four (each with 4 GiB), and the Mooncake
trace (512-token blocks, 400 blocks a replica) in serving mode on one and four replicas, in
``--repeats`` rounds (every workload once a round). Prints each replay's wall seconds (the best
of the rounds) and the median over the rounds of its ratio to the sequential replay of the same
workload in the same round. ``--baseline TREE`` times the same replays, in a child process
each, with the ``prefixcache`` package found in ``TREE`` (an older checkout, built): the figures
before a change, measured on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefixcache import CORE_BUILD, CacheManager
from prefixcache.replay import ReplayConfig, Source, open_source
from prefixcache.replay.runner import replay_source

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SCENARIO = ROOT / "scenarios" / "short_prompts_1m.yaml"
CHAT = ROOT / "scenarios" / "multi_turn_chat.yaml"
GIB = 1024**3
# (label, source, options): each planner workload's sequential replay comes first
PLANNER: list[tuple[str, Path, dict[str, Any]]] = [
    ("chat, sequential", CHAT, {"kv_memory": 4 * GIB, "model": "llama-3.1-8b"}),
    ("chat, serving", CHAT, {"kv_memory": 4 * GIB, "model": "llama-3.1-8b", "mode": "serving"}),
    (
        "chat, serving, 4 replicas",
        CHAT,
        {"kv_memory": 4 * GIB, "model": "llama-3.1-8b", "mode": "serving", "replicas": 4},
    ),
    ("Mooncake, sequential", TRACE, {"capacity_blocks": 400, "block_size": 512}),
    (
        "Mooncake, serving",
        TRACE,
        {"capacity_blocks": 400, "block_size": 512, "mode": "serving", "model": "llama-3.1-8b"},
    ),
    (
        "Mooncake, serving, 4 replicas",
        TRACE,
        {
            "capacity_blocks": 400,
            "block_size": 512,
            "mode": "serving",
            "model": "llama-3.1-8b",
            "replicas": 4,
        },
    ),
]


def layer_source(source: Source) -> tuple[float, int, int]:
    start = time.perf_counter()
    count = tokens = 0
    for req in source:
        count += 1
        tokens += len(req.tokens)
    return time.perf_counter() - start, count, tokens


def layer_manager(source: Source, cfg: ReplayConfig) -> float:
    mgr = CacheManager(cfg.capacity_blocks, cfg.block_size)
    admit, release = mgr.admit, mgr.release
    gc.disable()  # as the replay runs
    try:
        start = time.perf_counter()
        for i, req in enumerate(source):
            admit(i, req.tokens, req.namespace)
            release(i)
        return time.perf_counter() - start
    finally:
        gc.enable()


def bench(label: str, path: Path, cfg: ReplayConfig, n: int | None, repeats: int) -> None:
    def fresh() -> Source:
        source = open_source(path, cfg)
        return source if n is None else source.head(n)

    src_t, count, tokens = min(layer_source(fresh()) for _ in range(repeats))
    mgr_t = min(layer_manager(fresh(), cfg) for _ in range(repeats))
    results = [replay_source(fresh(), cfg) for _ in range(repeats)]
    best = min(results, key=lambda r: r.replay_seconds)
    report = best.to_report_dict()
    blocks = report["prompt_blocks"]
    print(
        f"{label}: {count:,} requests, {tokens:,} prompt tokens, {blocks:,} full blocks of "
        f"{cfg.block_size}, cache {cfg.capacity_blocks:,} blocks; token hit rate "
        f"{report['token_hit_rate']:.4f} (infinite {report['upper_bound_token_hit_rate']:.4f})"
    )
    for name, secs in (("source", src_t), ("manager", mgr_t), ("replay", best.replay_seconds)):
        print(
            f"  {name:8} {secs:8.2f} s  {count / secs:>11,.0f} req/s  "
            f"{count / secs * 60 / 1e6:6.2f} M req/min  {secs / count * 1e6:8.1f} us/req  "
            f"{secs / max(blocks, 1) * 1e6:7.2f} us/block"
        )


def time_replay(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """One replay of ``path`` in this process: wall seconds and the figures that must not
    change between builds."""
    cfg = ReplayConfig(**options)
    gc.collect()
    start = time.perf_counter()
    result = replay_source(open_source(path, cfg), cfg)
    seconds = time.perf_counter() - start
    report = result.to_report_dict()
    serving = report.get("serving") or {}
    return {
        "seconds": seconds,
        "requests": report["requests"],
        "token_hit_rate": report["token_hit_rate"],
        "ttft_p50_s": serving.get("ttft_p50_s"),
        "steps": serving.get("steps"),
        "core": CORE_BUILD.reason,
    }


def time_in(tree: Path, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """``time_replay`` in a child process that imports ``prefixcache`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import replay_speed as b; "
        "print(json.dumps(b.time_replay(__import__('pathlib').Path(sys.argv[2]), "
        "json.loads(sys.argv[3]))))"
    )
    args = [sys.executable, "-c", code, str(Path(__file__).parent), str(path), json.dumps(options)]
    # run from the tree: ``python -c`` puts the working directory first on the path
    out = subprocess.run(args, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def planner(repeats: int, baseline: Path | None) -> None:
    """The serving and fleet replays against the sequential replay of the same workload, in
    rounds: each round times every workload once (and the baseline's right after), so a drift
    of the machine's speed reaches a ratio's two sides alike. Prints each replay's best time and
    the median over the rounds of its ratio to the round's sequential replay."""
    print("planner workloads (wall seconds, best of the rounds; x: median over the rounds of")
    print("the ratio to the sequential replay of the same workload in the same round)")
    if baseline is not None:
        print(f"  baseline: prefixcache from {baseline}")
    work = [(label, path, options) for label, path, options in PLANNER if path.is_file()]
    for label, path, _ in PLANNER:
        if not path.is_file():
            print(f"  {label}: (no {path}; skipped)")
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in work}
    before: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in work}
    for _ in range(repeats):
        for label, path, options in work:
            runs[label].append(time_replay(path, options))
            if baseline is not None:
                before[label].append(time_in(baseline, path, options))
    if baseline is not None and work:
        print(f"  baseline core: {before[work[0][0]][0]['core']}")
    for label, _, _ in work:
        first = next(w for w, _, _ in work if w.split(",")[0] == label.split(",")[0])
        best = min(runs[label], key=lambda r: r["seconds"])
        secs = best["seconds"]
        line = (
            f"  {label:32} {secs:8.2f} s  {best['requests'] / secs:>8,.0f} req/s  "
            f"x{_median_ratio(runs[label], runs[first]):5.2f}  hit {best['token_hit_rate']:.4f}"
        )
        if best["ttft_p50_s"] is not None:
            line += f"  TTFT p50 {best['ttft_p50_s']:.4g} s  {best['steps']:,} steps"
        if baseline is not None:
            old = min(before[label], key=lambda r: r["seconds"])
            same = old["token_hit_rate"] == best["token_hit_rate"] and (
                old["ttft_p50_s"] == best["ttft_p50_s"]
            )
            x = _median_ratio(before[label], before[first])
            line += (
                f"  | baseline {old['seconds']:8.2f} s x{x:5.2f}"
                f" ({old['seconds'] / secs:4.1f}x this){'' if same else '  FIGURES DIFFER'}"
            )
        print(line, flush=True)


def _median_ratio(runs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> float:
    """The median over the rounds of ``runs``' seconds over ``reference``'s."""
    ratios = sorted(r["seconds"] / ref["seconds"] for r, ref in zip(runs, reference, strict=True))
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("sequential", "planner"), help="one part of the bench")
    ap.add_argument("--requests", type=int, default=1_000_000, help="scenario requests")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--baseline", type=Path, help="a checkout whose prefixcache to time too")
    args = ap.parse_args()
    if args.only != "sequential":
        planner(args.repeats, args.baseline)
    if args.only == "planner":
        return
    if args.trace.is_file():
        for capacity in (1000, 10000):
            bench(
                "Mooncake trace, 512-token blocks, LRU",
                args.trace,
                ReplayConfig(capacity_blocks=capacity, block_size=512),
                None,
                args.repeats,
            )
        bench(
            "Mooncake trace, 16-token blocks",
            args.trace,
            ReplayConfig(capacity_blocks=160_000, block_size=16),
            None,
            args.repeats,
        )
    else:
        print(f"(no Mooncake trace at {args.trace}; skipped)")
    bench(
        f"{SCENARIO.name}",
        SCENARIO,
        ReplayConfig(capacity_blocks=20_000, block_size=16),
        args.requests,
        args.repeats,
    )


if __name__ == "__main__":
    main()
