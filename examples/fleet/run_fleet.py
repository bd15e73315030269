"""A fleet on this machine: tiny replicas behind ``prefixcache serve``, compared across policies.

For each routing policy this starts N replicas (``replica.py``: the tiny random-weight runtime
with a real prefix cache, publishing its KV events on ZMQ), writes a fleet config naming their
URLs and event endpoints, starts ``prefixcache serve --proxy`` on it, waits for the service's
attach probe of each replica (printing anything it found), and sends a shared-prompt
workload (a few system prompts, each followed by many short user turns) through the service's
proxied ``/v1/completions``. Every policy starts from fresh processes, so fresh caches and a
fresh index. It prints, per policy, the fraction of prompt tokens the replicas served from their
caches, the requests each replica got, and what the router's index learned from the events.

    python examples/fleet/run_fleet.py [--replicas 3] [--requests 48] [--policies ...]

Everything listens on 127.0.0.1 only; every process is stopped at the end, on errors and on
Ctrl-C too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = "tiny-random"
VOCAB = 512  # the tiny model's vocabulary (examples/tiny_runtime.py)
BLOCK_SIZE = 16
START_DEADLINE_S = 90.0
INDEX_DEADLINE_S = 10.0
HTTP_TIMEOUT_S = 60.0
POLICIES = ("round_robin", "prefix", "prefix_balanced", "prefix_cost")


class Workload(NamedTuple):
    """Prompts (token ids) in the order they are sent, and which system prompt each starts with."""

    prompts: list[list[int]]
    systems: list[int]


class PolicyResult(NamedTuple):
    """What one policy's run measured."""

    policy: str
    requests: int
    prompt_tokens: int  # summed over the replicas' /stats
    cached_tokens: int  # prompt tokens the replicas served from their prefix caches
    per_replica: dict[str, int]  # replica name -> requests it served
    index_blocks: dict[str, int]  # replica name -> blocks the router's index holds for it
    ingest_events: int  # event messages the service ingested (its /metrics), 0 if not exported
    lookup_replica: str  # the replica that served the last prompt ...
    lookup_cached_tokens: int  # ... and the tokens of it /v1/lookup finds cached there

    @property
    def cached_fraction(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class StartedReplica(NamedTuple):
    """A replica process and what its /healthz said (model, block size, event endpoints)."""

    name: str
    url: str
    health: dict[str, Any]


@dataclass
class Processes:
    """Subprocesses started so far; ``stop_all`` ends each one (SIGTERM, then SIGKILL)."""

    log_dir: Path

    def __post_init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``python <args>`` from the repository root, output to ``<log_dir>/<name>.log``."""
        with open(self.log_dir / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Terminate every process still running and wait for each."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def log(self, name: str) -> str:
        """The output of process ``name`` so far."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(
    client: httpx.Client, procs: Processes, name: str, proc: subprocess.Popen[bytes], url: str
) -> dict[str, Any]:
    """Poll ``url``/healthz until it answers 200 (its JSON), the process exits, or a deadline."""
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{procs.log(name)}")
        try:
            resp = client.get(f"{url}/healthz", timeout=2.0)
            if resp.status_code == 200:
                return dict(resp.json())
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer at {url} in time:\n{procs.log(name)}")
        time.sleep(0.1)


def shared_prompt_workload(
    num_requests: int, num_systems: int = 4, system_len: int = 96, seed: int = 0
) -> Workload:
    """``num_systems`` system prompts of ``system_len`` tokens, each request one of them (at
    random) followed by a user turn of 4 to 24 random tokens."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, system_len).tolist() for _ in range(num_systems)]
    which = [int(rng.integers(0, num_systems)) for _ in range(num_requests)]
    prompts = [
        systems[s] + rng.integers(0, VOCAB, int(rng.integers(4, 25))).tolist() for s in which
    ]
    return Workload(prompts, which)


def fleet_config(policy: str, replicas: Sequence[StartedReplica]) -> dict[str, Any]:
    """The service config for the started replicas, proxying on, the index in memory."""
    return {
        "index": "memory",
        "tokenizer": None,
        "routing": {"policy": policy},
        "proxy": {"enabled": True, "timeout_s": HTTP_TIMEOUT_S},
        "replicas": [
            {
                "name": r.name,
                "url": r.url,
                "events": r.health["events"],
                "replay": r.health["replay"],
                "model": r.health["model"],
                "block_size": r.health["block_size"],
                "capacity_blocks": r.health["capacity_blocks"],
            }
            for r in replicas
        ],
    }


def wait_probed(client: httpx.Client, service: str) -> None:
    """Until the service's attach probe has checked every replica (two requests each, straight
    to the replica); a finding is printed, not raised."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        rows = client.get(f"{service}/v1/replicas").json()["replicas"]
        if all(row["probe"] is not None for row in rows):
            for row in rows:
                for finding in row["probe"]["findings"]:
                    if not finding["ok"]:
                        print(f"{row['name']}: {finding['check']}: {finding['detail']}")
            return
        time.sleep(0.1)
    raise RuntimeError(f"the attach probes of {service} did not finish in time")


def ingest_events(metrics_text: str) -> int:
    """The sum of ``prefixcache_ingest_events_total`` samples in a Prometheus exposition."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("prefixcache_ingest_events_total"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


class Fleet(NamedTuple):
    """A started fleet: the service's URL and the replicas behind it."""

    service: str
    replicas: list[StartedReplica]


@contextlib.contextmanager
def start_fleet(
    policy: str,
    procs: Processes,
    client: httpx.Client,
    *,
    num_replicas: int,
    num_blocks: int,
) -> Iterator[Fleet]:
    """Start ``num_replicas`` fresh replicas and ``prefixcache serve --proxy`` with ``policy``
    in front of them; every process is stopped when the block exits."""
    try:
        starting = []
        for i in range(num_replicas):
            name, port = f"replica-{i}", free_port()
            proc = procs.start(
                f"{policy}-{name}",
                [str(HERE / "replica.py"), "--port", str(port), "--model", MODEL,
                 "--blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE)],
            )  # fmt: skip
            starting.append((name, f"http://127.0.0.1:{port}", proc))
        replicas = [
            StartedReplica(name, url, wait_healthy(client, procs, f"{policy}-{name}", proc, url))
            for name, url, proc in starting
        ]
        config = procs.log_dir / f"{policy}-fleet.yaml"
        config.write_text(yaml.safe_dump(fleet_config(policy, replicas), sort_keys=False))
        port = free_port()
        service = f"http://127.0.0.1:{port}"
        proc = procs.start(
            f"{policy}-serve",
            ["-m", "prefixcache", "serve", "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port), "--proxy", "--log-level", "warning"],
        )  # fmt: skip
        wait_healthy(client, procs, f"{policy}-serve", proc, service)
        wait_probed(client, service)
        yield Fleet(service, replicas)
    finally:
        procs.stop_all()


def run_policy(
    policy: str,
    workload: Workload,
    procs: Processes,
    *,
    num_replicas: int,
    num_blocks: int,
    max_tokens: int,
) -> PolicyResult:
    """Start fresh replicas and a router with ``policy``, send the workload, measure, stop."""
    with (
        httpx.Client(timeout=HTTP_TIMEOUT_S) as client,
        start_fleet(policy, procs, client, num_replicas=num_replicas, num_blocks=num_blocks) as fl,
    ):
        service, replicas = fl
        # the attach probes' requests are in the replicas' counters already: counted from here
        before = {r.name: client.get(f"{r.url}/stats").json() for r in replicas}
        served_by: list[str] = []
        for prompt in workload.prompts:
            resp = client.post(
                f"{service}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
            )
            resp.raise_for_status()
            served_by.append(resp.headers["x-prefixcache-replica"])

        stats = {
            r.name: {
                k: v - before[r.name].get(k, 0)
                for k, v in client.get(f"{r.url}/stats").json().items()
                if k in ("requests", "prompt_tokens", "cached_tokens")
            }
            for r in replicas
        }
        last, last_replica = workload.prompts[-1], served_by[-1]
        lookup_cached = _wait_for_lookup(client, service, last, last_replica)
        listed = client.get(f"{service}/v1/replicas").json()["replicas"]
        events = ingest_events(client.get(f"{service}/metrics").text)
    return PolicyResult(
        policy=policy,
        requests=sum(s["requests"] for s in stats.values()),
        prompt_tokens=sum(s["prompt_tokens"] for s in stats.values()),
        cached_tokens=sum(s["cached_tokens"] for s in stats.values()),
        per_replica={name: s["requests"] for name, s in stats.items()},
        index_blocks={r["name"]: r["index_blocks"] for r in listed},
        ingest_events=events,
        lookup_replica=last_replica,
        lookup_cached_tokens=lookup_cached,
    )


def _wait_for_lookup(client: httpx.Client, service: str, prompt: list[int], replica: str) -> int:
    """Cached tokens of ``prompt`` on ``replica`` per the router's /v1/lookup, once its index
    has caught up with the events (0 when it has not within a few seconds)."""
    deadline = time.monotonic() + INDEX_DEADLINE_S
    while True:
        resp = client.post(f"{service}/v1/lookup", json={"model": MODEL, "tokens": prompt})
        resp.raise_for_status()
        cached = {s["name"]: s["cached_tokens"] for s in resp.json()["replicas"]}
        if cached.get(replica, 0) > 0 or time.monotonic() > deadline:
            return int(cached.get(replica, 0))
        time.sleep(0.05)


def run(
    policies: Sequence[str] = POLICIES,
    *,
    num_replicas: int = 3,
    num_requests: int = 48,
    num_systems: int = 4,
    system_len: int = 96,
    num_blocks: int = 256,
    max_tokens: int = 4,
    seed: int = 0,
    log_dir: Path | None = None,
    processes: list[subprocess.Popen[bytes]] | None = None,
) -> list[PolicyResult]:
    """Run the workload once per policy, each on fresh processes; logs go to ``log_dir`` (a
    temporary folder by default). Every started process is appended to ``processes``."""
    workload = shared_prompt_workload(num_requests, num_systems, system_len, seed)
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        results = []
        for policy in policies:
            procs = Processes(log_dir)
            try:
                results.append(
                    run_policy(
                        policy,
                        workload,
                        procs,
                        num_replicas=num_replicas,
                        num_blocks=num_blocks,
                        max_tokens=max_tokens,
                    )
                )
            finally:
                if processes is not None:
                    processes.extend(procs.procs)
        return results


def table(results: Sequence[PolicyResult]) -> str:
    """The results as a fixed-width text table."""
    lines = [
        f"{'policy':<16} {'requests':>8} {'prompt tok':>10} {'cached tok':>10} "
        f"{'cached':>7}  {'requests per replica':<28} {'index blocks':<16} {'events':>6}"
    ]
    for r in results:
        per = " ".join(str(n) for n in r.per_replica.values())
        blocks = " ".join(str(n) for n in r.index_blocks.values())
        lines.append(
            f"{r.policy:<16} {r.requests:>8} {r.prompt_tokens:>10} {r.cached_tokens:>10} "
            f"{r.cached_fraction:>7.1%}  {per:<28} {blocks:<16} {r.ingest_events:>6}"
        )
    return "\n".join(lines)


def iter_policies(text: str) -> Iterator[str]:
    """Comma-separated policy names, checked."""
    from prefixcache.fleet.policies import POLICIES as KNOWN

    for name in text.split(","):
        if name not in KNOWN:
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; choose from {', '.join(sorted(KNOWN))}"
            )
        yield name


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, run every policy and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--system-len", type=int, default=96, help="system prompt tokens")
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks per replica")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--policies", type=lambda t: list(iter_policies(t)), default=POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="keep the processes' logs and configs here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the fleet on SIGTERM as on Ctrl-C
    start = time.monotonic()
    try:
        results = run(
            args.policies,
            num_replicas=args.replicas,
            num_requests=args.requests,
            num_systems=args.systems,
            system_len=args.system_len,
            num_blocks=args.blocks,
            max_tokens=args.max_tokens,
            seed=args.seed,
            log_dir=args.log_dir,
        )
    except KeyboardInterrupt:  # every process was stopped on the way out
        raise SystemExit(130) from None
    print(
        f"{args.replicas} replicas, {args.requests} requests over {args.systems} system prompts "
        f"of {args.system_len} tokens, {time.monotonic() - start:.0f} s"
    )
    print(table(results))
    by_policy = {r.policy: r.cached_fraction for r in results}
    if {"prefix", "round_robin"} <= by_policy.keys() and (
        by_policy["prefix"] <= by_policy["round_robin"]
    ):
        raise SystemExit("prefix routing did not beat round robin")


if __name__ == "__main__":
    main()
