"""Sequential replay speed: the Mooncake synthetic trace and a generated 1,000,000-request scenario.

    python bench/replay_speed.py [--requests 1000000] [--trace PATH] [--repeats 1]

For each workload, three layers, so the cost of each is visible:
  source   reading / generating the requests alone (token arrays included)
  manager  source + CacheManager.admit/release, nothing else (the floor for any replay)
  replay   the full sequential replay: source, manager and hit accounting (shadow upper bound,
           miss causes, per-request rows)
Prints requests/s, requests/min, microseconds per request and per prompt block.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from prefixcache import CORE_BUILD, CacheManager
from prefixcache.replay import ReplayConfig, Source, open_source
from prefixcache.replay.runner import replay_source

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SCENARIO = ROOT / "scenarios" / "short_prompts_1m.yaml"


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


def main() -> None:
    print(f"core: {CORE_BUILD.reason}")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000, help="scenario requests")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
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
