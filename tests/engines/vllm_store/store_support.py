"""What the store connector's tests need from vLLM's virtualenv: whether it can run the
connector, and an import path that gives its processes this checkout's ``prefixcache`` (and
nothing else of the checkout: its top-level ``kernels/`` folder would shadow a package vLLM's
dependencies import).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from prefixcache.engines.vllm.connector_settings import transfer_config
from prefixcache.engines.vllm.install import MAKE_TARGET, VLLMInstall, find_vllm
from prefixcache.engines.vllm.install import vllm_missing_reason as _vllm_missing
from prefixcache.engines.vllm.launcher import VLLMServerSpec

PROM_PREFIX = "vllm:prefixcache_store_"

ROOT = Path(__file__).resolve().parents[3]
CONNECTOR_NEEDS = ("xxhash", "lmdb")  # in vLLM's virtualenv, besides vLLM


def connector_missing_reason(*, also: Sequence[str] = ()) -> str | None:
    """Why the store connector (and the modules ``also`` names) cannot run in vLLM's
    virtualenv here (None: they can)."""
    reason = _vllm_missing()
    if reason is not None:
        return reason
    install = find_vllm()
    needs = (*CONNECTOR_NEEDS, *also)
    probe = (
        "import importlib.util, sys; "
        f"sys.exit(0 if all(importlib.util.find_spec(m) for m in {needs!r}) else 1)"
    )
    done = subprocess.run([str(install.python), "-c", probe], capture_output=True)
    if done.returncode != 0:
        return (
            f"vLLM's virtualenv at {install.env} lacks some of {', '.join(needs)}: run "
            f"`{MAKE_TARGET}`"
        )
    return None


def checkout_import_path(folder: Path) -> Path:
    """A folder holding only a link to this checkout's ``prefixcache`` package, to put on
    ``PYTHONPATH`` for vLLM's processes."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "prefixcache"
    if not link.exists():
        link.symlink_to(ROOT / "prefixcache", target_is_directory=True)
    return folder


def vllm_install() -> VLLMInstall:
    """The ready install (call after ``connector_missing_reason`` returned None)."""
    return find_vllm()


# ---- real servers ------------------------------------------------------------------------


class Completion(NamedTuple):
    """One greedy completion: its text (the tiny tokenizer's words: equal text, equal
    tokens), the prompt tokens vLLM reported cached, and the time to the answer."""

    text: str
    cached_tokens: int
    seconds: float


def store_server(
    name: str,
    cpu: int | None,
    store: str,
    import_path: Path,
    *,
    env: dict[str, str] | None = None,
    **spec: Any,
) -> VLLMServerSpec:
    """A server with the store connector on ``store`` (this checkout's package on its path)."""
    return VLLMServerSpec(
        name,
        cpu=cpu,
        extra_args=("--kv-transfer-config", transfer_config(store)),
        extra_env={"PYTHONPATH": str(import_path), **(env or {})},
        **spec,
    )


def complete(url: str, tokens: list[int], max_tokens: int = 8, **body: Any) -> Completion:
    """A greedy completion of token ids ``tokens`` from the server at ``url``."""
    payload = {
        "model": "tiny-llama",
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        **body,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as answer:
        out = json.load(answer)
    seconds = time.monotonic() - start
    details = out["usage"].get("prompt_tokens_details") or {}
    return Completion(out["choices"][0]["text"], int(details.get("cached_tokens") or 0), seconds)


def store_counters(url: str) -> dict[str, float]:
    """The store connector's counters on the server's ``/metrics`` (name -> total)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(PROM_PREFIX) and "_total{" in line:
            name = line[len(PROM_PREFIX) : line.index("_total{")]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_for_counter(url: str, name: str, at_least: float, timeout_s: float = 120.0) -> float:
    """Wait until the server's counter ``name`` reaches ``at_least`` (the counts come with
    the engine's steps); its value, or AssertionError with every counter past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = store_counters(url)
        if counters.get(name, 0.0) >= at_least:
            return counters[name]
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed below {at_least} on {url}: {counters}")
        time.sleep(0.2)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary, one sequence per seed."""
    return [3 + (i * 7919 + seed * 104729) % 31000 for i in range(n)]
