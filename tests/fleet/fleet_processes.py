"""Starting and stopping the service and the fake upstream as subprocesses on 127.0.0.1, and
replicas that publish their managers' KV events over real ZMQ sockets."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import httpx
import yaml

from prefixcache import CacheManager, Namespace
from prefixcache.fleet.events.publisher import KVEventPublisher
from tests.fleet_support import free_port

ROOT = Path(__file__).resolve().parents[2]
FLEET_EXAMPLE = ROOT / "examples" / "fleet"
START_DEADLINE_S = 30.0


@contextlib.contextmanager
def running(module_args: Sequence[str], port: int, log: Path) -> Iterator[str]:
    """Run ``python -m <module_args>`` until its /healthz answers; yield its base URL; always
    stop it (SIGTERM, then SIGKILL after a grace period)."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", *module_args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{module_args[0]} exited with {proc.returncode}: {log.read_text()}"
                )
            try:
                if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{module_args[0]} did not answer in time: {log.read_text()}")
            time.sleep(0.1)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


class PublishingReplica:
    """An engine embedding the manager: it serves prompts (under a tenant's salt, when given)
    and publishes its KV events on loopback ZMQ sockets."""

    def __init__(self, num_blocks: int, model: str, block_size: int) -> None:
        self.model = model
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.mgr = CacheManager(num_blocks, block_size)
        self.publisher = KVEventPublisher(self.events, self.replay)
        self.publisher.attach(self.mgr)
        self.served = 0

    def serve(self, tokens: list[int], salt: str | None = None) -> None:
        rid = f"r{self.served}"
        self.served += 1
        self.mgr.admit(rid, tokens, Namespace(self.model, salt=salt))
        self.mgr.release(rid)
        self.publisher.flush()


def write_fleet_config(
    path: Path, replicas: dict[str, PublishingReplica], index: str, routing: dict, **extra: object
) -> Path:
    """A ``prefixcache serve`` config at ``path`` naming each replica's sockets and sizes."""
    config = {
        "index": index,
        "routing": routing,
        **extra,
        "replicas": [
            {
                "name": name,
                "events": rep.events,
                "replay": rep.replay,
                "model": rep.model,
                "block_size": rep.mgr.block_size,
                "capacity_blocks": rep.mgr.num_blocks,
            }
            for name, rep in replicas.items()
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def load_fleet_example(name: str) -> ModuleType:
    """``examples/fleet/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"fleet_example_{name}", FLEET_EXAMPLE / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
