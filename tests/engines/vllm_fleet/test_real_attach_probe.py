"""The attach probe names a real misconfiguration: a vLLM server started with another block size
than the service's config says, with its KV events off, with another hash algorithm
(``--prefix-caching-hash-algo``), or with a ``PYTHONHASHSEED`` the config does not name (vLLM
derives its first block's parent, ``NONE_HASH``, from that seed when it is set, from a fixed
string for the SHA-256 algorithms when it is not). One server at a time, started for its case;
the service follows it alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from real_fleet import BLOCK, serving

from prefixcache.engines.vllm import VLLMInstall, VLLMServer, free_port

Start = Callable[..., VLLMServer]

ODD = "vllm-odd"
KV_BYTES = 64 << 20


def _probe(tmp_path: Path, server: Any, model: Path, **replica: Any) -> dict[str, Any]:
    """The service's attach probe of ``server``, configured with ``replica`` overrides, once
    the server's events reach the service (its socket connects after the service binds): each
    check's finding by name."""
    with serving(tmp_path, [server], model, replica_overrides={ODD: replica}) as service:
        service.wait_probed([ODD])  # the probe when it first answered
        found = service.probe(ODD)
    assert found["ok"] is False, found
    return found


@pytest.fixture
def events() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_a_server_with_another_block_size_is_named(
    odd_server: Start, vllm_install: VLLMInstall, tmp_path: Path, events: str
) -> None:
    server = odd_server(kv_cache_bytes=KV_BYTES, block_size=2 * BLOCK, events=events)
    found = _probe(tmp_path, server, vllm_install.model, block_size=BLOCK)
    assert not found["prefix hit"]["ok"]
    assert f"block size looks like {2 * BLOCK}" in found["prefix hit"]["detail"]
    assert not found["events"]["ok"]
    assert f"block_size {2 * BLOCK}" in found["events"]["detail"], found["events"]


def test_a_server_without_kv_events_is_named(
    odd_server: Start, vllm_install: VLLMInstall, tmp_path: Path, events: str
) -> None:
    server = odd_server(kv_cache_bytes=KV_BYTES, block_size=BLOCK, events=None)
    configured = {"events": events, "events_bind": True}  # the service expects events there
    found = _probe(tmp_path, server, vllm_install.model, **configured)
    assert found["prefix hit"]["ok"] and found["cache report"]["ok"]
    assert not found["events"]["ok"]
    assert "no KV event batch came" in found["events"]["detail"]


def test_a_server_with_another_hash_algorithm_is_named(
    odd_server: Start, vllm_install: VLLMInstall, tmp_path: Path, events: str
) -> None:
    server = odd_server(
        kv_cache_bytes=KV_BYTES, block_size=BLOCK, events=events, hash_algo="sha256_cbor"
    )
    configured = {"engine_hash": "vllm"}  # vLLM's default, sha256
    found = _probe(tmp_path, server, vllm_install.model, **configured)
    assert found["events"]["ok"], found["events"]
    assert not found["engine hash"]["ok"]
    assert "algo 'sha256_cbor' (configured: 'sha256')" in found["engine hash"]["detail"]


def test_a_server_with_another_hash_seed_is_named(
    odd_server: Start, vllm_install: VLLMInstall, tmp_path: Path, events: str
) -> None:
    server = odd_server(kv_cache_bytes=KV_BYTES, block_size=BLOCK, events=events, hash_seed="0")
    configured = {"engine_hash": {"engine": "vllm", "algo": "sha256"}}  # PYTHONHASHSEED unset
    found = _probe(tmp_path, server, vllm_install.model, **configured)
    assert found["events"]["ok"], found["events"]
    assert not found["engine hash"]["ok"]
    assert "seed '0' (configured: None)" in found["engine hash"]["detail"]
