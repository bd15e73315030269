"""Starting and stopping the service and the fake upstream as subprocesses on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
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
