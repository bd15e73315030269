"""HTTP routing throughput of ``prefixcache serve``, measured with a real load generator.

    python bench/http_routes.py [--rounds 3] [--duration 10] [--index memory|redis]
                                [--workers N] [--baseline-root DIR] [--auth] [--large 262144]
                                [--paced-rate 1000] [--floor]

Starts ``prefixcache serve`` (a subprocess, the ``python -m prefixcache serve`` of this checkout,
or of ``--baseline-root`` for the baseline) on 127.0.0.1 with a YAML config of 16 replicas of one
model (block size 16). The replicas are stand-ins: each is a ``KVEventPublisher`` in this
script, bound on 127.0.0.1 with a replay endpoint, whose one batch stores a different depth of
one of four 1k-token prompt families (0 to 100% of the prompt) and, on replica r00, a 262,144-token
chain. The service learns them the way it learns a real engine's cache: its subscriber connects,
sees a later batch and replays the missed one. The script waits until ``GET /v1/replicas`` shows
every replica's blocks, so every route hashes and matches against a filled index. With ``--index
redis`` a redis-server is started on a free port and the service's subscriber writes there
(``--workers N`` needs it: each worker is a process of its own over the shared index).

Then, for each service (candidate, and baseline when ``--baseline-root`` is given, alternating
round by round):

- max rate: ``wrk -t2 -c32 -d10s`` with a Lua script posting ``/v1/route`` bodies of 1k token
  ids (16 prompts, each the family's prefix and a private tail) -> routes/s;
- half that rate (or ``--paced-rate``), paced, two ways when hey is installed -> p50 and p99 of
  each:
  - ``hey -c 8 -q`` (a per-connection rate limit): one process whose 8 rate limiters start
    together and stay in step, so its requests arrive in bursts of 8 (at 1,000/s, 8 requests
    every 8 ms, the last of each burst queued behind the other 7);
  - spread: 8 hey processes of one connection each, started one interval (1 / rate) apart, so
    arrivals are spread out as from independent callers; their per-request CSV rows are
    merged;
  the service's own route-latency histogram (``/metrics``) says, per spread run, how many routes
  took the router over 1 ms; with ``--floor``, GET ``/health`` (no work behind it) is paced the
  spread way too: the latency the machine, the client and the HTTP stack give on their own;
  without hey, a paced asyncio client over httpx (fixed send schedule, latency counted from the
  scheduled time, so a stall is not hidden);
- a large prompt: one keep-alive client routes a 262,144-token body and a 1k body alternately;
  median times and the ratio of the time per block (target: at most linear, ratio ~1 or less).

Also the service's CPU time per route under wrk (user + system of its process group, from
/proc): on a shared machine, where the routes/s wrk sees depend on what else runs, this says what
one core of the service can do (1 / CPU per route).

It prints the load generator it used, each round, and the medians. Targets: 2,000 routes/s and p99
<= 5 ms at half that rate. ``--auth`` compares the same service with and without an API key
(access control on/off) instead of two checkouts; ``--workers N`` without ``--baseline-root``
compares one worker with N over the same Redis index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
BLOCK = 16
BENCH_KEY = "sk-bench-http-routes-0123456789"
LUA = """
local bodies = {}
for i = 0, %(n)d - 1 do
  local f = io.open("%(dir)s/body" .. i .. ".json", "rb")
  bodies[i + 1] = f:read("*all")
  f:close()
end
local k = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%(auth)s
request = function()
  k = k %% #bodies + 1
  return wrk.format(nil, "/v1/route", nil, bodies[k])
end
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prompts(tokens: int, large: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Four prompt families, 16 prompts to route (family prefix + private quarter), and a large
    prompt."""
    rng = np.random.default_rng(0)
    families = [rng.integers(0, 128_000, tokens).astype("<i4") for _ in range(4)]
    routed = []
    for k in range(16):
        p = families[k % 4].copy()
        p[3 * tokens // 4 :] = rng.integers(0, 128_000, tokens - 3 * tokens // 4)
        routed.append(p)
    return families, routed, rng.integers(0, 128_000, large).astype("<i4")


class StandInReplicas:
    """One KV-event publisher per replica, each holding one batch that stores its blocks."""

    def __init__(self, replicas: int, families: list[np.ndarray], large: np.ndarray) -> None:
        from prefixcache.blocks.hashing import BlockHasher
        from prefixcache.blocks.namespace import Namespace
        from prefixcache.fleet.events.publisher import KVEventPublisher
        from prefixcache.manager.block_events import BlockStored

        ns = Namespace(MODEL)
        hasher = BlockHasher(BLOCK)
        blocks = len(families[0]) // BLOCK
        self.expected: dict[str, int] = {}
        self.publishers = []
        self.names = [f"r{i:02d}" for i in range(replicas)]
        for i, name in enumerate(self.names):
            pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            depth = blocks * (i + 1) // replicas
            fam = families[i % 4]
            chain = hasher.hash_prompt(fam, ns)[:depth]
            stored = [(chain, fam[: depth * BLOCK].tolist())]
            if i == 0:  # the large prompt's chain too (a separate prefix)
                stored.append((hasher.hash_prompt(large, ns), large.tolist()))
            for digests, toks in stored:
                if digests:
                    pub.on_event(BlockStored(list(digests), None, toks, BLOCK, ns))
            pub.flush()
            self.expected[name] = sum(len(d) for d, _ in stored)
            self.publishers.append(pub)

    def config(self, index: str, keys_file: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "hash_algo": "xxh3_128",
            "routing": {"policy": "prefix_balanced"},
            "health": {"probe_interval_s": None},
            "limits": {"max_body_bytes": 8 * 1024 * 1024, "max_prompt_tokens": 262_144},
            **({"auth": {"keys_file": keys_file}} if keys_file else {}),
            "replicas": [
                {
                    "name": name,
                    "model": MODEL,
                    "block_size": BLOCK,
                    "capacity_blocks": 1_000_000,
                    "events": pub.endpoint,
                    "replay": pub.replay_endpoint,
                }
                for name, pub in zip(self.names, self.publishers, strict=True)
            ],
        }

    def nudge(self) -> None:
        """Publish an empty batch, so a subscriber that joined late asks for the earlier ones."""
        from prefixcache.fleet.events.wire import KVEventBatch, encode_batch

        for pub in self.publishers:
            pub.publish_payload(encode_batch(KVEventBatch(ts=time.time(), events=[]), pub.layout))

    def close(self) -> None:
        for pub in self.publishers:
            pub.close()


class Service:
    """``prefixcache serve`` of checkout ``root`` on a free port, seeded from the stand-ins."""

    def __init__(
        self, root: Path, cfg: Path, index: str | None, workers: int, label: str, log: Path
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.label = label
        cmd = [sys.executable, "-m", "prefixcache", "serve", "--config", str(cfg)]
        cmd += ["--port", str(self.port)]  # the default log level, as an operator runs it
        if index:
            cmd += ["--index", index]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=env, start_new_session=True, stdout=self.log, stderr=self.log
        )

    def wait_seeded(self, stand_ins: StandInReplicas, headers: dict[str, str]) -> None:
        import httpx

        deadline = time.monotonic() + 120
        with httpx.Client(base_url=self.base, timeout=10.0, headers=headers) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.label}: the service exited ({self.proc.returncode}): "
                        + Path(self.log.name).read_text()[-2000:]
                    )
                try:
                    rows = client.get("/v1/replicas").json()["replicas"]
                    held = {r["name"]: r["index_blocks"] for r in rows}
                    if all(held.get(n) == b for n, b in stand_ins.expected.items()):
                        return
                except (httpx.TransportError, KeyError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.label}: the index was not seeded in time")
                stand_ins.nudge()
                time.sleep(0.3)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) of the processes of group ``pgid`` (the service and its
    workers), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields from the state on: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])
    return total / tick


def run_wrk(base: str, lua: Path, threads: int, conns: int, duration: int) -> tuple[float, int]:
    """Routes/s at the maximum rate wrk reaches, and the routes it made; fails on any non-2xx
    answer."""
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}s", "-s", str(lua), base],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    done = re.search(r"(\d+) requests in", out)
    assert match and done, out
    return float(match.group(1)), int(done.group(1))


def hey_command(
    url: str, body: Path | None, rate: float, conns: int, duration: int, auth: bool
) -> list[str]:
    """hey at ``rate`` requests/s over ``conns`` connections (its rate limit is per
    connection): POST ``body`` to ``url``, or GET it when ``body`` is None."""
    cmd = ["hey", "-z", f"{duration}s", "-c", str(conns), "-q", f"{rate / conns:.2f}"]
    if body is not None:
        cmd += ["-m", "POST", "-T", "application/json", "-D", str(body)]
    if auth:
        cmd += ["-H", f"Authorization: Bearer {BENCH_KEY}"]
    return cmd + [url]


def run_hey(base: str, body: Path, rate: float, conns: int, duration: int, auth: bool) -> tuple:
    """p50 and p99 (seconds) at ``rate`` routes/s: hey's per-connection rate limit."""
    cmd = hey_command(f"{base}/v1/route", body, rate, conns, duration, auth)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.stdout
    codes = re.findall(r"\[(\d{3})\]\s+(\d+) responses", text)
    if any(code != "200" for code, _ in codes) or "Error distribution" in text:
        raise RuntimeError(f"hey saw errors:\n{text}")
    pcts = dict(re.findall(r"(\d+)%% in ([\d.]+) secs".replace("%%", "%"), text))
    got = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    return float(pcts["50"]), float(pcts["99"]), got


def run_hey_spread(
    url: str, body: Path | None, rate: float, clients: int, duration: int, auth: bool
) -> tuple:
    """p50 and p99 (seconds) at ``rate`` requests/s from ``clients`` hey processes of one
    connection each, started ``1 / rate`` apart, their per-request rows (``-o csv``) merged;
    POST ``body`` to ``url``, or GET it when ``body`` is None."""
    cmd = hey_command(url, body, rate / clients, 1, duration, auth)
    cmd[1:1] = ["-o", "csv"]  # a row per request
    procs = []
    for _ in range(clients):
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(1.0 / rate)
    lat: list[float] = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"hey failed: {err.decode()[-500:]}")
        rows = out.decode().splitlines()[1:]  # response-time,DNS+dialup,...,status-code,offset
        for row in rows:
            cells = row.split(",")
            if cells[6] != "200":
                raise RuntimeError(f"hey saw a {cells[6]} answer")
            lat.append(float(cells[0]))
    got = len(lat) / duration
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), got


def router_times(base: str, headers: dict[str, str]) -> list[tuple[float, float]]:
    """The service's own route-latency histogram (``prefixcache_route_latency_seconds``, the
    router's work inside the service): (bucket bound in seconds, routes so far at or under
    it)."""
    import httpx

    text = httpx.get(f"{base}/metrics", headers=headers, timeout=10.0).text
    rows = re.findall(r'prefixcache_route_latency_seconds_bucket\{le="([^"]+)"\} ([\d.e+]+)', text)
    return [(float(le), float(n)) for le, n in rows]


def run_paced(base: str, bodies: list[bytes], rate: float, duration: int, auth: bool) -> tuple:
    """p50 and p99 at ``rate`` routes/s from a paced asyncio client: request k is due at
    k / rate, and its latency runs from then (a stall delays and counts every later one)."""
    import httpx

    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = f"Bearer {BENCH_KEY}"
    total = int(rate * duration)

    async def main() -> list[float]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0) as client:
            start = time.perf_counter()
            lat: list[float] = []

            async def one(k: int) -> None:
                due = start + k / rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                r = await client.post("/v1/route", content=bodies[k % len(bodies)], headers=headers)
                r.raise_for_status()
                lat.append(time.perf_counter() - due)

            await asyncio.gather(*(one(k) for k in range(total)))
            return lat

    lat = asyncio.run(main())
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), total / duration


def large_cost(base: str, small: bytes, large: bytes, repeats: int, auth: bool) -> tuple:
    """Median seconds of one route of the small and of the large body, alternating."""
    import httpx

    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = f"Bearer {BENCH_KEY}"
    times: dict[bool, list[float]] = {False: [], True: []}
    with httpx.Client(base_url=base, timeout=60.0) as client:
        for i in range(repeats * 2 + 2):
            big = i % 2 == 1
            t = time.perf_counter()
            r = client.post("/v1/route", content=large if big else small, headers=headers)
            elapsed = time.perf_counter() - t
            assert r.status_code == 200, r.text[:300]
            if i >= 2:  # one of each to warm up
                times[big].append(elapsed)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk / paced run")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--large", type=int, default=262_144, help="tokens of the large prompt")
    ap.add_argument("--index", choices=("memory", "redis"), default="memory")
    ap.add_argument("--workers", type=int, default=1, help="service workers (needs redis)")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paced-connections", type=int, default=8)
    ap.add_argument("--paced-client", choices=("auto", "hey", "python"), default="auto")
    ap.add_argument(
        "--paced-rate",
        type=float,
        help="routes/s of the paced runs (default: half the round's max rate; the target's "
        "own figure is 1000, half of 2,000)",
    )
    ap.add_argument("--baseline-root", type=Path, help="a checkout to compare against")
    ap.add_argument("--auth", action="store_true", help="compare access control on vs off")
    ap.add_argument("--skip-paced", action="store_true")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also pace GET /health the spread way: what the machine and the HTTP stack alone "
        "give at that rate",
    )
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    if args.workers > 1 and args.index != "redis":
        ap.error("--workers needs --index redis (each worker is a process of its own)")
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("wrk is needed (apt-get install wrk)")
    hey = shutil.which("hey") if args.paced_client in ("auto", "hey") else None
    if args.paced_client == "hey" and hey is None:
        sys.exit("hey is not installed (apt-get install hey)")
    ver = subprocess.run([wrk, "-v"], capture_output=True, text=True)
    print(f"max rate: {(ver.stdout or ver.stderr).splitlines()[0]} ({wrk})")
    print(
        f"paced: hey ({hey}), -q per connection: one process of {args.paced_connections} "
        f"connections (bursts), and {args.paced_connections} processes of one (spread)"
        if hey
        else "paced: asyncio + httpx client (fixed schedule, latency from the due time)"
    )
    work = Path(tempfile.mkdtemp(prefix="http_routes_"))
    families, routed, large = prompts(args.tokens, args.large)
    stand_ins = StandInReplicas(args.replicas, families, large)
    bodies = [json.dumps({"model": MODEL, "tokens": p.tolist()}).encode() for p in routed]
    for i, b in enumerate(bodies):
        (work / f"body{i}.json").write_bytes(b)
    large_body = json.dumps({"model": MODEL, "tokens": large.tolist()}).encode()
    redis_proc = None
    index = None
    if args.index == "redis":
        rport = free_port()
        redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            cwd=work,
        )
        index = f"redis://127.0.0.1:{rport}/0"
        time.sleep(0.5)
    (work / "keys.yaml").write_text(f"{BENCH_KEY}: {{role: operator, name: bench}}\n")
    import yaml

    # (label, checkout, access control on, workers)
    variants: list[tuple[str, Path, bool, int]] = [("candidate", ROOT, False, args.workers)]
    if args.auth:
        variants = [("auth off", ROOT, False, args.workers), ("auth on", ROOT, True, args.workers)]
    elif args.baseline_root:
        base_root = args.baseline_root.resolve()
        variants = [("baseline", base_root, False, 1), ("candidate", ROOT, False, args.workers)]
    elif args.workers > 1:  # one worker against N, over the same Redis index
        variants = [
            ("1 worker", ROOT, False, 1),
            (f"{args.workers} workers", ROOT, False, args.workers),
        ]
    for label, _, auth, _ in variants:
        cfg = stand_ins.config(index or "memory", "keys.yaml" if auth else None)
        (work / f"{label.replace(' ', '_')}.yaml").write_text(yaml.safe_dump(cfg))
        auth_line = f'wrk.headers["Authorization"] = "Bearer {BENCH_KEY}"' if auth else ""
        lua = LUA % {"n": len(bodies), "dir": work, "auth": auth_line}
        (work / f"{label.replace(' ', '_')}.lua").write_text(lua)
    print(
        f"{args.tokens}-token prompts, {args.replicas} replicas, block {BLOCK}, index "
        f"{args.index}, workers {args.workers}; wrk -t{args.threads} -c{args.connections} "
        f"-d{args.duration}s"
    )
    results: dict[str, dict[str, list[float]]] = {v[0]: {} for v in variants}
    try:
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for label, root, auth, workers in order:
                name = label.replace(" ", "_")
                if redis_proc is not None and index is not None:  # the same starting index
                    import redis

                    redis.Redis.from_url(index).flushdb()
                log = work / f"{name}.log"
                svc = Service(root, work / f"{name}.yaml", index, workers, label, log)
                headers = {"authorization": f"Bearer {BENCH_KEY}"} if auth else {}
                try:
                    svc.wait_seeded(stand_ins, headers)
                    run_wrk(svc.base, work / f"{name}.lua", args.threads, args.connections, 2)
                    cpu = cpu_seconds(svc.proc.pid)
                    rate, done = run_wrk(
                        svc.base,
                        work / f"{name}.lua",
                        args.threads,
                        args.connections,
                        args.duration,
                    )
                    cpu_us = (cpu_seconds(svc.proc.pid) - cpu) / done * 1e6
                    row = results[label]
                    row.setdefault("routes/s", []).append(rate)
                    row.setdefault("server CPU us/route", []).append(cpu_us)
                    line = (
                        f"round {rnd} {label}: {rate:.0f} routes/s, server CPU {cpu_us:.0f} us "
                        f"per route ({1e6 / cpu_us:.0f} routes per CPU-second)"
                    )
                    if not args.skip_paced:
                        paced = args.paced_rate or rate / 2
                        if hey:
                            p50, p99, got = run_hey(
                                svc.base,
                                work / "body0.json",
                                paced,
                                args.paced_connections,
                                args.duration,
                                auth,
                            )
                        else:
                            p50, p99, got = run_paced(svc.base, bodies, paced, args.duration, auth)
                        row.setdefault("p50 ms", []).append(p50 * 1e3)
                        row.setdefault("p99 ms", []).append(p99 * 1e3)
                        line += (
                            f"; at {paced:.0f}/s asked ({got:.0f}/s got): "
                            f"p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms"
                        )
                        if hey:
                            before = router_times(svc.base, headers)
                            p50, p99, got = run_hey_spread(
                                f"{svc.base}/v1/route",
                                work / "body0.json",
                                paced,
                                args.paced_connections,
                                args.duration,
                                auth,
                            )
                            after = router_times(svc.base, headers)
                            row.setdefault("spread p50 ms", []).append(p50 * 1e3)
                            row.setdefault("spread p99 ms", []).append(p99 * 1e3)
                            line += (
                                f"; spread ({got:.0f}/s got): "
                                f"p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms"
                            )
                            if before and after:  # routes whose router work took over 1 ms
                                n_routes = after[-1][1] - before[-1][1]
                                fast = dict(after)[0.001] - dict(before)[0.001]
                                slow = 100.0 * (n_routes - fast) / max(n_routes, 1.0)
                                row.setdefault("router > 1 ms %", []).append(slow)
                                line += f" (router work over 1 ms: {slow:.2f}%)"
                        if hey and args.floor:
                            p50, p99, got = run_hey_spread(
                                f"{svc.base}/health",
                                None,
                                paced,
                                args.paced_connections,
                                args.duration,
                                auth,
                            )
                            row.setdefault("floor p50 ms", []).append(p50 * 1e3)
                            row.setdefault("floor p99 ms", []).append(p99 * 1e3)
                            line += (
                                f"; floor, GET /health spread ({got:.0f}/s got): "
                                f"p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms"
                            )
                    if not args.skip_large:
                        small_t, large_t = large_cost(svc.base, bodies[0], large_body, 3, auth)
                        ratio = (large_t / len(large)) / (small_t / args.tokens)
                        row.setdefault("1k ms", []).append(small_t * 1e3)
                        row.setdefault("large ms", []).append(large_t * 1e3)
                        row.setdefault("per-block ratio", []).append(ratio)
                        line += (
                            f"; {args.tokens} tokens {small_t * 1e3:.2f} ms, {len(large)} tokens "
                            f"{large_t * 1e3:.1f} ms (per block x{ratio:.2f})"
                        )
                    print(line, flush=True)
                finally:
                    svc.stop()
    finally:
        stand_ins.close()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("medians:")
    for label, row in results.items():
        cells = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row.items())
        print(f"  {label}: {cells}")
    print(
        "targets: >= 2000 routes/s; p99 <= 5 ms at half that rate (spread and bursts); "
        "per-block ratio <= ~1"
    )


if __name__ == "__main__":
    main()
