"""Helpers for the service's access and transport tests: an app over a seeded in-memory index, a
keys file, the app served by uvicorn in a thread on 127.0.0.1, and a replica stand-in that keeps
what the proxy forwards."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fastapi import FastAPI

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import ServiceConfig, parse_config
from prefixcache.fleet.service.transport import BatchedAcceptServer, uvicorn_config
from tests.fleet_support import free_port, wait_until

MODEL = "m"
BLOCK = 4
ALICE = "sk-alice-0123456789abcdef"  # tenant alice
ALICE2 = "sk-alice-second-key-000000"  # a second key of tenant alice
MALLORY = "sk-mallory-0123456789abcdef"  # tenant mallory
OPERATOR = "sk-operator-0123456789abcdef"  # operator, no tenant
KEYS_YAML = f"""
{ALICE}: alice
{ALICE2}: {{tenant: alice, name: alice-2}}
{MALLORY}: {{tenant: mallory, name: mallory}}
{OPERATOR}: {{role: operator, name: ops}}
"""


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def make_config(
    tmp: Path, *, keys: bool = True, extra: dict[str, Any] | None = None, proxy: bool = False
) -> ServiceConfig:
    data: dict[str, Any] = {
        "index": "memory",
        "health": {"probe_interval_s": None},
        "proxy": {"enabled": proxy},
        "limits": {"max_body_bytes": 64 * 1024, "max_prompt_tokens": 4096},
        "replicas": [
            {"name": "r1", "model": MODEL, "block_size": BLOCK, "url": "http://replica-1"},
            {"name": "r2", "model": MODEL, "block_size": BLOCK, "url": "http://replica-2"},
        ],
    }
    if keys:
        (tmp / "keys.yaml").write_text(KEYS_YAML)
        data["auth"] = {"keys_file": "keys.yaml"}
    for section, values in (extra or {}).items():
        if isinstance(values, dict):
            data[section] = {**data.get(section, {}), **values}
        else:
            data[section] = values
    return parse_config(data, "test.yaml", tmp)


def round_robin_app(
    tmp_path: Path, block_size: int, capacity_blocks: int, **sections: Any
) -> FastAPI:
    """An app over two empty replicas, ``a`` and ``b``, routed round robin, with the config's
    other ``sections`` (``whatif``, ``record_trace``, ``auth`` ...; paths relative to
    ``tmp_path``)."""
    config = parse_config(
        {
            "routing": {"policy": "round_robin"},
            **sections,
            "replicas": [
                {"name": n, "model": MODEL, "block_size": block_size,
                 "capacity_blocks": capacity_blocks}
                for n in ("a", "b")
            ],
        },
        "fleet.yaml",
        tmp_path,
    )  # fmt: skip
    return make_app(config)[0]


def make_app(config: ServiceConfig) -> tuple[FastAPI, MemoryFleetIndex]:
    index = MemoryFleetIndex()
    for replica in config.replicas:
        index.store(replica.name, [])
    return build_service(config, index=index, ingest=None), index


def engine_stores(
    index: MemoryFleetIndex, replica: str, tokens: Sequence[int], salt: str | None
) -> None:
    """What a replica's KV events put in the index once it cached ``tokens`` under ``salt``."""
    digests = BlockHasher(BLOCK).hash_prompt(list(tokens), Namespace(MODEL, salt=salt))
    index.store(replica, digests)


class ReplicaAnswer(NamedTuple):
    """A whole JSON answer, as ``ReplicaClient.post`` gives one."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    content_type: str = "application/json"
    streamed: bool = False

    def close(self) -> None:
        """Nothing to release."""


class Replicas:
    """A stand-in for the replicas in proxy mode: answers every forwarded request and keeps its
    body and headers (``client()`` takes the place of the service's ``http_client``)."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> ReplicaAnswer:
        self.seen.append((json.loads(body), dict(headers)))
        answer = json.dumps({"object": "text_completion", "choices": []}).encode()
        return ReplicaAnswer(200, [(b"content-type", b"application/json")], answer)

    async def close(self) -> None:
        """Nothing to close."""

    def client(self) -> Replicas:
        return self


@contextlib.contextmanager
def serving(app: FastAPI, config: ServiceConfig) -> Iterator[str]:
    """``app`` served by uvicorn (with the config's limits and TLS) in a thread; its base URL."""
    port = free_port()
    server = BatchedAcceptServer(uvicorn_config(app, config, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
        assert server.started, "the server did not start"
        scheme = "https" if config.server.tls else "http"
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
