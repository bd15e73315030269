"""Route latency: 8k-token prompts across 16 replicas, in process and over loopback HTTP.

    python bench/route_latency.py [--routes 400] [--repeats 5] [--tokens 8192] [--replicas 16]

In process: ``Router.route`` on an int32 array and on a Python list (what a JSON body gives),
each route counted as load and released. Over HTTP: the service in a uvicorn subprocess on
127.0.0.1 and one keep-alive httpx client posting ``/v1/route`` bodies of token ids. Each repeat
gives p50 and p99; the medians of the repeats are printed with the targets (p99 <= 1 ms in
process, <= 5 ms over HTTP).

Also the time to check and render a 21-message conversation through a Llama-3-style chat
template, which a chat route adds before tokenizing.

The index is the in-memory fleet index (``prefixcache.fleet.index.memory_index``). Every
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
    from prefixcache.fleet.index.open_index import open_index

    return open_index("memory"), "MemoryFleetIndex"


def build(tokens: int, replicas: int) -> tuple[Any, str, list[np.ndarray]]:
    """A seeded router and the prompts to route."""
    from prefixcache.blocks.hashing import BlockHasher
    from prefixcache.blocks.namespace import Namespace
    from prefixcache.fleet.replica_spec import ReplicaSpec
    from prefixcache.fleet.router import Router

    ns = Namespace(MODEL)
    rng = np.random.default_rng(0)
    families = [rng.integers(0, 128_000, tokens).astype("<i4") for _ in range(4)]
    index, label = make_index()
    hasher = BlockHasher(BLOCK)
    chains = [hasher.hash_prompt(f, ns) for f in families]
    blocks = tokens // BLOCK
    for i in range(replicas):
        depth = blocks * (i + 1) // replicas
        index.store(f"r{i:02d}", chains[i % 4][:depth])
    specs = [ReplicaSpec(f"r{i:02d}", ns, BLOCK, 4 * blocks) for i in range(replicas)]
    router = Router(index, specs, "prefix_balanced")
    prompts = []
    for k in range(16):  # the family's prefix, then a private tail of a quarter of the prompt
        p = families[k % 4].copy()
        p[3 * tokens // 4 :] = rng.integers(0, 128_000, tokens - 3 * tokens // 4)
        prompts.append(p)
    return router, label, prompts


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


def serve(port: int, tokens: int, replicas: int) -> None:
    """The service over the seeded router (run in a subprocess by the HTTP part)."""
    import uvicorn

    from prefixcache.fleet.service.app import create_app
    from prefixcache.fleet.service.settings import parse_config

    router, _, _ = build(tokens, replicas)
    config = parse_config(
        {
            "replicas": [{"name": s.name, "model": MODEL} for s in router.replicas()],
            "limits": {"max_body_bytes": 64 * tokens, "max_prompt_tokens": 2 * tokens},
        }
    )
    uvicorn.run(create_app(router, config), host="127.0.0.1", port=port, log_level="warning")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--routes", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tokens, args.replicas)
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
