"""Fleet index figures: ingest blocks/s (memory, memory+compact, Redis pipelined), bytes per
(block, replica) for the in-process indexes (digests included), match latency for a 512-block
prompt over 16 replicas, and KV events through the subscriber into Redis with and without
the shared engine map (alternating; blocks/s and Redis memory per block). Medians of repeats.

    python bench/fleet_ingest.py [--blocks 200000] [--repeats 5] [--redis-url URL]

Without ``--redis-url`` a redis-server is started on a free port; with it, the Redis figures are
taken on that index URL (``redis+cluster://host:port`` for a Redis Cluster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import tracemalloc

from prefixcache.fleet.events import wire as kv_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.index.compact import CompactFleetIndex
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex

RUN = 64  # blocks per stored run, as one KV event carries them


def ingest_rate(index, digests) -> float:
    t = time.perf_counter()
    for i in range(0, len(digests), RUN):
        index.store("pod-0", digests[i : i + RUN])
    if hasattr(index, "flush"):
        index.flush()
    return len(digests) / (time.perf_counter() - t)


def bytes_per_block(kind, n: int, replicas: int) -> float:
    """Bytes the index keeps per (block, replica), digests included: each run's digest objects
    are made inside the measurement and dropped after the store, as the event intake drops
    them, so whatever the index keeps of them counts. Each block held by ``replicas``
    replicas."""
    index = kind()
    runs = [os.urandom(16 * RUN) for _ in range(0, n, RUN)]  # one object per run, made before
    tracemalloc.start()
    for r in range(replicas):
        for raw in runs:
            index.store(f"pod-{r}", [raw[i : i + 16] for i in range(0, len(raw), 16)])
    structures, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return structures / (len(runs) * RUN * replicas)


def match_latency(index, repeats: int) -> tuple[float, float]:
    prompt = [os.urandom(16) for _ in range(512)]
    for r in range(16):
        index.store(f"r{r}", prompt[: 32 * (r + 1)])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        index.match(prompt)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def event_batches(n: int, block_size: int = 16) -> list[bytes]:
    """vLLM-style batches of one BlockStored each: chains of RUN blocks, as prompts store them."""
    out = []
    for i in range(0, n, RUN):
        hashes = list(range(i + 1, i + RUN + 1))
        tokens = [(i * 7 + t) % 50_000 for t in range(RUN * block_size)]
        event = kv_wire.WireBlockStored(hashes, None, tokens, block_size, None, "GPU", None)
        out.append(kv_wire.encode_batch(kv_wire.KVEventBatch(0.0, [event])))
    return out


def event_ingest(url: str, tag: str, batches: list[bytes], engine_map: bool) -> tuple[float, float]:
    """(blocks/s, Redis bytes per block) for ``batches`` through a subscriber."""
    index = RedisFleetIndex.from_url(url, prefix=tag)
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod-0", block_size=16)])
    if not engine_map:  # the index alone, as before the map was kept
        sub._engine_map = sub._events.engine_map = None
    before = int(index.client.info("memory")["used_memory"])
    t = time.perf_counter()
    for seq, payload in enumerate(batches):
        sub.ingest("pod-0", seq, payload)
    index.flush()
    seconds = time.perf_counter() - t
    used = int(index.client.info("memory")["used_memory"]) - before
    index.clear("pod-0")
    index.close()
    return len(batches) * RUN / seconds, used / (len(batches) * RUN)


def unplaced_batches(n: int, orphan: bool, block_size: int = 16) -> list[bytes]:
    """Batches of RUN-block runs, each under its own first block (``orphan``: under a parent
    never stored, as a router that joined late sees them)."""
    out = []
    for i in range(0, n, RUN):
        hashes = list(range(i + 1, i + RUN + 1))
        parent = (1 << 40) + i if orphan else None
        tokens = [(i * 7 + t) % 50_000 for t in range(RUN * block_size)]
        event = kv_wire.WireBlockStored(hashes, parent, tokens, block_size, None, "GPU", None)
        out.append(kv_wire.encode_batch(kv_wire.KVEventBatch(0.0, [event])))
    return out


def unplaced_ingest(batches: list[bytes]) -> float:
    """Blocks/s of ``batches`` through a subscriber (engine keys on) into a memory index."""
    from prefixcache.fleet.events.engine_keys import EngineHashSpec

    spec = EngineHashSpec("vllm", "sha256_cbor")
    sub = KVEventSubscriber(MemoryFleetIndex(), [ReplicaEndpoint("pod-0", engine_hash=spec)])
    t = time.perf_counter()
    for seq, payload in enumerate(batches):
        sub.ingest("pod-0", seq, payload)
    return len(batches) * RUN / (time.perf_counter() - t)


def unplaced_figures(n: int, repeats: int) -> None:
    """Events whose parents are known (placed, digests) against ones whose parents were never
    seen (kept unplaced by engine hash), alternating; medians and their ratio."""
    kinds = {False: unplaced_batches(n, False), True: unplaced_batches(n, True)}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for k in range(repeats):
        for orphan in (k % 2 == 0, k % 2 == 1):
            rates[orphan].append(unplaced_ingest(kinds[orphan]))
    placed, kept = (statistics.median(rates[x]) for x in (False, True))
    print(f"events via subscriber, parents known (placed):   {placed:,.0f} blocks/s")
    print(f"events via subscriber, parents unseen (unplaced): {kept:,.0f} blocks/s")
    print(f"unplaced/placed ingest rate ratio: {kept / placed:.2f}")


def start_redis() -> tuple[subprocess.Popen[bytes], str] | None:
    if shutil.which("redis-server") is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        cwd=tempfile.mkdtemp(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            RedisFleetIndex.from_url(url).client.ping()
            return proc, url
        except Exception:
            time.sleep(0.05)
    proc.kill()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--redis-url", help="an index URL to measure instead of a fresh redis-server")
    ap.add_argument("--unplaced", action="store_true", help="only blocks under unseen parents")
    args = ap.parse_args()
    n = args.blocks
    if args.unplaced:
        unplaced_figures(n, args.repeats)
        return
    kinds = {"memory": MemoryFleetIndex, "memory+compact": CompactFleetIndex}
    rates: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.repeats):  # the two in-process indexes alternate
        digests = [os.urandom(16) for _ in range(n)]
        for name, kind in kinds.items():
            rates[name].append(ingest_rate(kind(), digests))
    for name, kind in kinds.items():
        print(f"{name} ingest: {statistics.median(rates[name]):,.0f} blocks/s")
        for replicas in (1, 4):
            per_pair = bytes_per_block(kind, n, replicas)
            print(
                f"{name} bytes per (block, replica), {replicas} replica(s) per block, digests "
                f"included: {per_pair:.1f}"
            )
        p50, p99 = match_latency(kind(), 1000)
        print(f"{name} match, 512 blocks x 16 replicas: p50 {p50:.0f} us, p99 {p99:.0f} us")
    proc = None
    if args.redis_url:
        url = args.redis_url
    else:
        server = start_redis()
        if server is None:
            print("redis: skipped (redis-server not found)")
            return
        proc, url = server
    tag = "{%s}" if "+cluster" in url else "%s"  # one hash slot on a cluster
    try:
        rates = []
        for k in range(args.repeats):
            index = RedisFleetIndex.from_url(url, prefix=tag % f"bench{k}{os.getpid()}")
            rates.append(ingest_rate(index, [os.urandom(16) for _ in range(n)]))
            index.close()
        print(f"redis ingest (pipelined): {statistics.median(rates):,.0f} blocks/s  [{url}]")
        index = RedisFleetIndex.from_url(url, prefix=tag % f"match{os.getpid()}")
        p50, p99 = match_latency(index, 300)
        index.close()
        print(f"redis match, 512 blocks x 16 replicas: p50 {p50:.0f} us, p99 {p99:.0f} us")
        batches = event_batches(n)
        figures: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for k in range(args.repeats):
            for on in (k % 2 == 0, k % 2 == 1):  # alternate which goes first
                figures[on].append(
                    event_ingest(url, tag % f"ev{k}{on:d}{os.getpid()}", batches, on)
                )
        for on in (False, True):
            rate = statistics.median(r for r, _ in figures[on])
            size = statistics.median(b for _, b in figures[on])
            label = "with the engine map" if on else "index only        "
            print(f"redis events via subscriber, {label}: {rate:,.0f} blocks/s, {size:.0f} B/block")
        ratio = statistics.median(r for r, _ in figures[True]) / statistics.median(
            r for r, _ in figures[False]
        )
        print(f"engine map ingest rate ratio (on/off): {ratio:.2f}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
