"""Route latency: 8k-token prompts across 16 replicas, in process and over loopback HTTP.

    python bench/route_latency.py [--routes 400] [--repeats 5] [--tokens 8192] [--replicas 16]
    python bench/route_latency.py --auth [--routes 300] [--repeats 6]
    python bench/route_latency.py --attribution [--routes 400] [--repeats 7]
    python bench/route_latency.py --whatif [--routes 400] [--repeats 7]

In process: ``Router.route`` on an int32 array and on a Python list (what a JSON body gives),
each route counted as load and released. Over HTTP: the service in a uvicorn subprocess on
127.0.0.1 and one keep-alive httpx client posting ``/v1/route`` bodies of token ids. Each repeat
gives p50 and p99; the medians of the repeats are printed with the targets (p99 <= 1 ms in
process, <= 5 ms over HTTP).

Also the time to check and render a 21-message conversation through a Llama-3-style chat
template, which a chat route adds before tokenizing.

``--auth`` adds the cost of access control: two services side by side, one as without keys (plain
uvicorn, no limits) and one with an API key of a tenant, per-key rate and in-flight limits, and
the config's connection and read limits (``server``); routes alternate between them one by one
(ABBA) and the ratio of the medians of their p50s and p99s is printed (target: at most 1.05).
The same comparison runs first through the two ASGI apps in this process, which leaves out the
sockets and the second process (and their noise on a busy machine). Each
service's index holds the prompts under the namespace its routes see, so both do the same work.

``--attribution``: the delivery check's cost (a prediction kept per routed request id, checked
against the engine's figure on release, the attribution sums): two apps in this process, one
with ``delivery: {enabled: false}``, routes alternating ABBA; p50, p99 and CPU per route +
release on each side and their ratios (target: p99 and CPU within 3%). ``--whatif``: the same
for the live what-if curves (1% sampling, the default), the delivery check off on both sides.

The index is the in-memory fleet index (``prefixcache.fleet.index.memory``). Every
replica holds a different depth of one of four prompt families (0 to 100% of the prompt), so each
route hashes all 512 blocks and each replica's match ends at another block.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
BLOCK = 16


def make_index() -> tuple[Any, str]:
    """The in-memory fleet index, and a label for it."""
    from prefixcache.fleet.index.from_url import open_index

    return open_index("memory"), "MemoryFleetIndex"


POLICY = "prefix_balanced"


def build(tokens: int, replicas: int, salt: str | None = None) -> tuple[Any, str, list[np.ndarray]]:
    """A seeded router and the prompts to route (indexed under ``salt``)."""
    from prefixcache.blocks.namespace import Namespace
    from prefixcache.fleet.replica_spec import ReplicaSpec
    from prefixcache.fleet.router import Router

    index, label, prompts = seeded_index(tokens, replicas, salt)
    blocks = tokens // BLOCK
    specs = [ReplicaSpec(f"r{i:02d}", Namespace(MODEL), BLOCK, 4 * blocks) for i in range(replicas)]
    return Router(index, specs, POLICY), label, prompts


def seeded_index(
    tokens: int, replicas: int, salt: str | None = None
) -> tuple[Any, str, list[np.ndarray]]:
    """The index with every replica's depth of its prompt family (under ``salt``), its label,
    and the prompts to route."""
    from prefixcache.blocks.hashing import BlockHasher
    from prefixcache.blocks.namespace import Namespace

    rng = np.random.default_rng(0)
    families = [rng.integers(0, 128_000, tokens).astype("<i4") for _ in range(4)]
    index, label = make_index()
    hasher = BlockHasher(BLOCK)
    seeded = Namespace(MODEL, salt=salt)
    chains = [hasher.hash_prompt(f, seeded) for f in families]
    blocks = tokens // BLOCK
    for i in range(replicas):
        depth = blocks * (i + 1) // replicas
        index.store(f"r{i:02d}", chains[i % 4][:depth])
    prompts = []
    for k in range(16):  # the family's prefix, then a private tail of a quarter of the prompt
        p = families[k % 4].copy()
        p[3 * tokens // 4 :] = rng.integers(0, 128_000, tokens - 3 * tokens // 4)
        prompts.append(p)
    return index, label, prompts


def service_config(tokens: int, replicas: int, **sections: Any) -> Any:
    """The config of the service over ``seeded_index``: its replicas (as ``build`` gives the
    router), the policy, no in-flight timeout, the limits a route of ``tokens`` needs, and the
    other ``sections``."""
    from prefixcache.fleet.service.configuration.config_file import parse_config

    capacity = 4 * (tokens // BLOCK)
    data: dict[str, Any] = {
        "replicas": [
            {"name": f"r{i:02d}", "model": MODEL, "block_size": BLOCK, "capacity_blocks": capacity}
            for i in range(replicas)
        ],
        "routing": {"policy": POLICY, "in_flight_timeout_s": None},
        "limits": {"max_body_bytes": 64 * tokens, "max_prompt_tokens": 2 * tokens},
        **sections,
    }
    return parse_config(data)


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


def in_process(router: Any, prompts: list[Any], routes: int) -> tuple[float, float]:
    from prefixcache.blocks.namespace import Namespace

    ns = Namespace(MODEL)
    times = []
    for i in range(routes):
        prompt = prompts[i % len(prompts)]
        start = time.perf_counter()
        router.route(ns, prompt, request_id=f"q{i}")
        times.append(time.perf_counter() - start)
        router.release(f"q{i}")
    return percentiles(times)


BENCH_KEY = "sk-bench-route-latency-0123456789"
KEYS_ENV = "PREFIXCACHE_BENCH_KEYS"


def serve(port: int, tokens: int, replicas: int, secure: bool = False) -> None:
    """The service over the seeded router (run in a subprocess by the HTTP part); ``secure``:
    with a tenant's API key, per-key limits and the connection and read limits."""
    import uvicorn

    from prefixcache.fleet.service.transport import uvicorn_config

    app, config = _app(tokens, replicas, secure)
    if secure:
        uvicorn.Server(uvicorn_config(app, config, "127.0.0.1", port, "warning")).run()
    else:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _start(args: argparse.Namespace, secure: bool) -> tuple[subprocess.Popen[bytes], str]:
    """A service subprocess on a free port, and its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", str(port), "--tokens", str(args.tokens)]
    cmd += ["--replicas", str(args.replicas)] + (["--secure"] if secure else [])
    return subprocess.Popen(cmd, cwd=ROOT), f"http://127.0.0.1:{port}"


def _wait_healthy(client: Any, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _app(tokens: int, replicas: int, secure: bool) -> tuple[Any, Any]:
    """The service app over a seeded router (with keys and per-key limits when ``secure``),
    and its config."""
    import os

    from prefixcache.fleet.service.assembly import build_service

    index, _, _ = seeded_index(tokens, replicas, "tenant:bench" if secure else None)
    data: dict[str, Any] = {}
    if secure:
        os.environ[KEYS_ENV] = f"{{{BENCH_KEY}: bench}}"
        data["auth"] = {
            "keys_env": KEYS_ENV,
            "max_in_flight_per_key": 1000,
            "rate_per_s": 1e6,
            "burst": 1000000,
        }
        data["server"] = {"max_connections": 1000, "header_timeout_s": 10, "body_timeout_s": 30}
    config = service_config(tokens, replicas, **data)
    return build_service(config, index=index, ingest=None), config


def auth_overhead_asgi(args: argparse.Namespace, prompts: list[np.ndarray]) -> float:
    """The same comparison through the ASGI apps in this process (no sockets, no second
    process): what the key check, the tenant salt, the per-key limits and the body timeout
    add per route. Prints the figures; returns the p50 ratio."""
    import asyncio

    import httpx

    bodies = [
        json.dumps({"model": MODEL, "tokens": p.tolist(), "request_id": "h"}).encode()
        for p in prompts
    ]
    release = json.dumps({"request_id": "h"}).encode()

    async def run() -> dict[bool, list[tuple[float, float]]]:
        samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        clients = {}
        for secure in (False, True):
            headers = {"content-type": "application/json"}
            if secure:
                headers["authorization"] = f"Bearer {BENCH_KEY}"
            transport = httpx.ASGITransport(_app(args.tokens, args.replicas, secure)[0])
            clients[secure] = httpx.AsyncClient(
                transport=transport, base_url="http://bench", headers=headers
            )
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * args.routes):
                secure = bool(i % 2) != bool((i // 2) % 2)  # ABBA order
                client = clients[secure]
                start = time.perf_counter()
                r = await client.post("/v1/route", content=bodies[(i // 2) % len(bodies)])
                times[secure].append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                assert (await client.post("/v1/release", content=release)).status_code == 200
            if repeat:
                for secure, values in times.items():
                    samples[secure].append(percentiles(values))
        for client in clients.values():
            await client.aclose()
        return samples

    return _report("in process (ASGI)", asyncio.run(run()))


def feature_overhead(args: argparse.Namespace, prompts: list[np.ndarray], section: str) -> None:
    """Route + release with the delivered figure, with one feature (config ``section``:
    ``delivery`` or ``whatif``) on and off: two ASGI apps in this process, routes alternating
    ABBA; p50 and p99 of the route, and the process's CPU time per route + release on each
    side. The other feature is off on both."""
    import asyncio

    import httpx

    from prefixcache.fleet.service.assembly import build_service

    bodies = [
        json.dumps({"model": MODEL, "tokens": p.tolist(), "request_id": "h"}).encode()
        for p in prompts
    ]

    def app(enabled: bool) -> Any:
        index, _, _ = seeded_index(args.tokens, args.replicas)
        config = service_config(
            args.tokens,
            args.replicas,
            delivery={"enabled": enabled if section == "delivery" else False},
            whatif={"enabled": enabled if section == "whatif" else False},
        )
        return build_service(config, index=index, ingest=None)

    async def run() -> tuple[dict[bool, list[tuple[float, float]]], dict[bool, float]]:
        samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        cpu = {False: 0.0, True: 0.0}
        apps = {on: app(on) for on in (False, True)}
        clients = {
            on: httpx.AsyncClient(
                transport=httpx.ASGITransport(apps[on]),
                base_url="http://bench",
                headers={"content-type": "application/json"},
            )
            for on in (False, True)
        }
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * args.routes):
                on = bool(i % 2) != bool((i // 2) % 2)  # ABBA order
                client = clients[on]
                c0 = time.process_time()
                start = time.perf_counter()
                r = await client.post("/v1/route", content=bodies[(i // 2) % len(bodies)])
                times[on].append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                # an honest engine: it delivers what the route predicted
                release = {"request_id": "h", "cached_tokens": r.json()["cached_tokens"]}
                assert (await client.post("/v1/release", json=release)).status_code == 200
                if repeat:
                    cpu[on] += time.process_time() - c0
            if repeat:
                for on, values in times.items():
                    samples[on].append(percentiles(values))
        if section == "delivery":
            stats = (await clients[True].get("/v1/stats")).json()["attribution"]
            assert stats and stats[0]["requests"] == (args.repeats + 1) * args.routes, stats
        else:
            curves = (await clients[True].get("/v1/whatif")).json()
            assert curves["window"]["routed_requests"] == (args.repeats + 1) * args.routes
        for client in clients.values():
            await client.aclose()
        return samples, cpu

    samples, cpu = asyncio.run(run())
    n = args.repeats * args.routes
    p50 = {k: statistics.median(v[0] for v in samples[k]) * 1e3 for k in samples}
    p99 = {k: statistics.median(v[1] for v in samples[k]) * 1e3 for k in samples}
    what = "delivery check and attribution" if section == "delivery" else "what-if curves (1%)"
    print(
        f"{what}, in process (ASGI), {args.tokens}-token routes with a "
        f"request id, each released with the engine's cached tokens; medians of {args.repeats} "
        "repeats:"
    )
    for on, name in ((False, "off"), (True, "on")):
        print(
            f"  {name:4} p50 {p50[on]:7.3f} ms  p99 {p99[on]:7.3f} ms  "
            f"CPU {cpu[on] / n * 1e6:7.1f} us per route + release"
        )
    ratios = (p50[True] / p50[False], p99[True] / p99[False], cpu[True] / cpu[False])
    verdict = "met" if max(ratios[1:]) <= 1.03 else "NOT met"
    print(
        f"  ratio p50 {ratios[0]:.3f}, p99 {ratios[1]:.3f}, CPU {ratios[2]:.3f}  "
        f"(target p99 and CPU <= 1.03: {verdict})"
    )


def _report(where: str, samples: dict[bool, list[tuple[float, float]]]) -> float:
    p50 = {k: statistics.median(v[0] for v in samples[k]) * 1e3 for k in samples}
    p99 = {k: statistics.median(v[1] for v in samples[k]) * 1e3 for k in samples}
    print(f"access control, {where}, medians of {len(samples[False])} repeats:")
    for secure, name in ((False, "no keys, no limits"), (True, "tenant key + limits")):
        print(f"  {name:22} p50 {p50[secure]:7.3f} ms  p99 {p99[secure]:7.3f} ms")
    ratio = p50[True] / p50[False]
    verdict = "met" if ratio <= 1.05 else "NOT met"
    tail = p99[True] / p99[False]
    print(f"  ratio p50 {ratio:.3f}, p99 {tail:.3f}  (target p50 <= 1.05: {verdict})")
    return ratio


def auth_overhead(args: argparse.Namespace, prompts: list[np.ndarray]) -> None:
    """Route latency with and without access control, routes interleaved; prints the
    ratio of the medians (secured / open)."""
    import httpx

    bodies = [
        json.dumps({"model": MODEL, "tokens": p.tolist(), "request_id": "h"}).encode()
        for p in prompts
    ]
    release = json.dumps({"request_id": "h"}).encode()
    open_proc, open_base = _start(args, False)
    secure_proc, secure_base = _start(args, True)
    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        plain = {"content-type": "application/json"}
        keyed = {**plain, "authorization": f"Bearer {BENCH_KEY}"}
        with (
            httpx.Client(base_url=open_base, timeout=10.0, headers=plain) as open_client,
            httpx.Client(base_url=secure_base, timeout=10.0, headers=keyed) as secure_client,
        ):
            clients = {False: open_client, True: secure_client}
            _wait_healthy(open_client, open_proc)
            _wait_healthy(secure_client, secure_proc)
            for client in clients.values():  # warm-up
                for _ in range(50):
                    client.post("/v1/route", content=bodies[0])
                    client.post("/v1/release", content=release)
            for _ in range(args.repeats):  # routes interleaved one by one: same conditions
                times: dict[bool, list[float]] = {False: [], True: []}
                for i in range(2 * args.routes):
                    secure = bool(i % 2) != bool((i // 2) % 2)  # ABBA order
                    client = clients[secure]
                    start = time.perf_counter()
                    r = client.post("/v1/route", content=bodies[(i // 2) % len(bodies)])
                    times[secure].append(time.perf_counter() - start)
                    assert r.status_code == 200, r.text
                    assert client.post("/v1/release", content=release).status_code == 200
                for secure, values in times.items():
                    samples[secure].append(percentiles(values))
    finally:
        _stop(open_proc)
        _stop(secure_proc)
    _report("over loopback HTTP (two uvicorn processes)", samples)


def over_http(args: argparse.Namespace, prompts: list[np.ndarray]) -> list[tuple[float, float]]:
    """p50 and p99 of each repeat, timed at the client; prints the server's own route time."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", str(port), "--tokens", str(args.tokens)]
    cmd += ["--replicas", str(args.replicas)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    bodies = [
        json.dumps({"model": MODEL, "tokens": p.tolist(), "request_id": "h"}).encode()
        for p in prompts
    ]
    release = json.dumps({"request_id": "h"}).encode()
    headers = {"content-type": "application/json"}
    results = []
    try:
        with httpx.Client(base_url=base, timeout=10.0) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                time.sleep(0.2)
            for _ in range(50):  # warm-up
                client.post("/v1/route", content=bodies[0], headers=headers)
                client.post("/v1/release", content=release, headers=headers)
            for _ in range(args.repeats):
                times = []
                for i in range(args.routes):
                    start = time.perf_counter()
                    r = client.post("/v1/route", content=bodies[i % len(bodies)], headers=headers)
                    times.append(time.perf_counter() - start)
                    assert r.status_code == 200, r.text
                    client.post("/v1/release", content=release, headers=headers)
                results.append(percentiles(times))
            scrape = client.get("/metrics").text
            total = count = 0.0
            for line in scrape.splitlines():
                if line.startswith("prefixcache_route_latency_seconds_sum"):
                    total = float(line.split()[-1])
                elif line.startswith("prefixcache_route_latency_seconds_count"):
                    count = float(line.split()[-1])
            print(f"server side, Router.route alone: mean {total / max(count, 1) * 1e3:.3f} ms")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return results


# a Llama-3-style template: a BOS, a header per turn, trimmed contents
LLAMA_STYLE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def chat_render(turns: int, chars: int, repeats: int) -> float:
    """Median seconds to check and render a conversation of ``turns`` messages through the
    chat template, as a chat route does before tokenizing."""
    from prefixcache.text.chat_template import ChatTemplate, chat_messages

    template = ChatTemplate(LLAMA_STYLE, {"bos_token": "<|begin_of_text|>"})
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    messages = [{"role": "system", "content": text}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": text} for i in range(turns)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(100):
            template.render(chat_messages(messages, template.content_format))
        times.append((time.perf_counter() - t0) / 100)
    return statistics.median(times)


def unplaced_overhead(args: argparse.Namespace) -> None:
    """Routes while every replica holds blocks stored under a parent the router never saw (it
    joined late): each route then computes the prompt's engine hashes (vLLM's, once per route)
    and matches them on every replica. Alternating with the index alone; medians, ratio."""
    from prefixcache.blocks.namespace import Namespace
    from prefixcache.fleet.events import wire as kv_wire
    from prefixcache.fleet.events.engine_keys import EngineHasher, EngineHashSpec
    from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint

    router, _, prompts = build(args.tokens, args.replicas)
    ns = Namespace(MODEL)
    stored = kv_wire.WireBlockStored([1 << 41], 1 << 40, [1] * BLOCK, BLOCK, None, "GPU", None)
    payload = kv_wire.encode_batch(kv_wire.KVEventBatch(0.0, [stored]))
    print(f"{args.tokens}-token prompts, {args.replicas} replicas with unplaced blocks")
    for algo in ("sha256_cbor", "xxhash_cbor"):
        spec = EngineHashSpec("vllm", algo, "0")
        names = [s.name for s in router.replicas()]
        sub = KVEventSubscriber(
            router.index,
            [ReplicaEndpoint(n, namespace=ns, block_size=BLOCK, engine_hash=spec) for n in names],
        )
        for n in names:
            sub.ingest(n, 0, payload)
        figures: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for k in range(args.repeats):
            for on in (k % 2 == 0, k % 2 == 1):
                router.attach_held(sub.unplaced if on else None)
                figures[on].append(in_process(router, prompts, args.routes))
        router.attach_held(None)
        cold = []
        hasher = EngineHasher(spec, BLOCK)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for prompt in prompts:
                hasher.digests(prompt)
            cold.append((time.perf_counter() - t0) / len(prompts))
        print(
            f"{algo}: a prompt's engine hashes, first computed: "
            f"{statistics.median(cold) * 1e3:.2f} ms ({args.tokens // BLOCK} blocks)"
        )
        off, on = (
            (
                statistics.median(v[0] for v in figures[x]),
                statistics.median(v[1] for v in figures[x]),
            )
            for x in (False, True)
        )
        print(
            f"{algo}: index alone p50 {off[0] * 1e3:.3f} ms p99 {off[1] * 1e3:.3f} ms; "
            f"with engine keys p50 {on[0] * 1e3:.3f} ms p99 {on[1] * 1e3:.3f} ms; "
            f"ratio p50 {on[0] / off[0]:.2f} p99 {on[1] / off[1]:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--routes", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--auth", action="store_true", help="only the access-control comparison")
    ap.add_argument("--unplaced", action="store_true", help="only the engine-key lookup cost")
    ap.add_argument(
        "--attribution", action="store_true", help="only the delivery check's cost, on vs off"
    )
    ap.add_argument("--whatif", action="store_true", help="only the what-if curves' cost, on/off")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--secure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tokens, args.replicas, args.secure)
        return
    if args.auth:
        prompts = build(args.tokens, args.replicas)[2]
        auth_overhead_asgi(args, prompts)
        auth_overhead(args, prompts)
        return
    if args.unplaced:
        unplaced_overhead(args)
        return
    if args.attribution or args.whatif:
        section = "delivery" if args.attribution else "whatif"
        feature_overhead(args, build(args.tokens, args.replicas)[2], section)
        return
    router, label, prompts = build(args.tokens, args.replicas)
    as_lists = [p.tolist() for p in prompts]
    print(f"{args.tokens}-token prompts, {args.replicas} replicas, block {BLOCK}, index: {label}")
    in_process(router, prompts, 100)  # warm-up
    rows: dict[str, list[tuple[float, float]]] = {"in process, int32 array": []}
    rows["in process, list of ints"] = []
    for _ in range(args.repeats):
        rows["in process, int32 array"].append(in_process(router, prompts, args.routes))
        rows["in process, list of ints"].append(in_process(router, as_lists, args.routes))
    rows["HTTP /v1/route, loopback"] = over_http(args, prompts)
    targets = {"in process": 1.0, "HTTP": 5.0}
    print(f"{'':28} {'p50 ms':>8} {'p99 ms':>8}  target p99  (medians of {args.repeats} repeats)")
    for name, values in rows.items():
        p50 = statistics.median(v[0] for v in values) * 1e3
        p99 = statistics.median(v[1] for v in values) * 1e3
        target = targets["HTTP" if name.startswith("HTTP") else "in process"]
        verdict = "met" if p99 <= target else "NOT met"
        print(f"{name:28} {p50:8.3f} {p99:8.3f}  <= {target:.0f} ms {verdict}")
    render = chat_render(20, 1600, args.repeats)
    print(f"chat template, 21 messages of 1,600 characters: {render * 1e6:.0f} us per render")


if __name__ == "__main__":
    main()
