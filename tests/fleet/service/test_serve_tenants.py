"""Tenants in `prefixcache serve`: the service counts each key's tenant's GPU blocks per replica
from the replicas' KV events, tells evictions by a neighbour from a tenant's own in /metrics, and
with ``routing.tenant_shares`` sends a tenant's new prompts where its share has room.

Two replicas' managers publish over real ZMQ sockets; the engine sees the tenant salt the
service hands out (``cache_salt`` in the route's answer), as vLLM hashes it into every block."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.fleet.events.tenant_tally import TenantTally, tenant_of
from tests.fleet.fleet_processes import PublishingReplica, running, write_fleet_config
from tests.fleet_support import free_port, wait_until

MODEL = "tiny-model"
BLOCK = 4
ACME = "sk-acme-0123456789abcdef0000"
GLOBEX = "sk-globex-0123456789abcdef00"
OPS = "sk-operator-0123456789abcdef"
KEYS = f"{ACME}: acme\n{GLOBEX}: globex\n{OPS}: {{role: operator, name: ops}}\n"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    replicas = {"a": PublishingReplica(24, MODEL, BLOCK), "b": PublishingReplica(24, MODEL, BLOCK)}
    (tmp_path / "keys.yaml").write_text(KEYS)
    routing = {"policy": "prefix", "tenant_shares": {"acme": 8}}
    auth = {"keys_file": "keys.yaml"}
    path = write_fleet_config(tmp_path / "fleet.yaml", replicas, "memory", routing, auth=auth)
    port = free_port()
    args = ["prefixcache", "serve", "--config", str(path), "--port", str(port)]
    try:
        with running(args, port, tmp_path / "serve.log") as base, httpx.Client(base_url=base) as c:
            yield {"client": c, "replicas": replicas}
    finally:
        for rep in replicas.values():
            rep.publisher.close()


def _tenant_metrics(client: httpx.Client) -> dict[tuple[str, ...], float]:
    text = client.get("/metrics", headers={"authorization": f"Bearer {OPS}"}).text
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "prefixcache_tenant_gpu_blocks":
                out[("gpu", s.labels["replica"], s.labels["tenant"])] = s.value
            elif s.name == "prefixcache_tenant_evicted_blocks_total":
                out[(s.labels["by"], s.labels["replica"], s.labels["tenant"])] = s.value
    return out


def _route(client: httpx.Client, key: str, tokens: list[int]) -> dict[str, Any]:
    answer = client.post(
        "/v1/route",
        json={"model": MODEL, "tokens": tokens},
        headers={"authorization": f"Bearer {key}"},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def _prompt(i: int) -> list[int]:
    return [1000 * i + t for t in range(4 * BLOCK + 1)]  # 4 full blocks and one token


def test_tenant_blocks_evictions_and_routing_by_share(fleet):
    client, replicas = fleet["client"], fleet["replicas"]
    first = _route(client, ACME, _prompt(0))
    salt = first["cache_salt"]
    assert tenant_of(salt) == "acme"
    for i in range(3):  # acme fills replica a with 12 blocks, past its share of 8
        replicas["a"].serve(_prompt(i), salt)
    wait_until(lambda: _tenant_metrics(client).get(("gpu", "a", "acme")) == 12)

    # a new acme prompt goes where acme has room (b), every time; its cached prompt stays on a
    for _ in range(4):
        assert _route(client, ACME, _prompt(50))["replica"] == "b"
    assert _route(client, ACME, _prompt(1))["replica"] == "a"
    # globex has no share: its cold prompts go by the policy alone (both replicas take turns)
    assert {_route(client, GLOBEX, _prompt(60))["replica"] for _ in range(4)} == {"a", "b"}

    # globex's burst on a evicts acme's blocks: counted as evicted by others
    globex_salt = _route(client, GLOBEX, _prompt(70))["cache_salt"]
    for i in range(70, 73):
        replicas["a"].serve(_prompt(i), globex_salt)
    wait_until(lambda: _tenant_metrics(client).get(("others", "a", "acme"), 0) > 0)
    m = _tenant_metrics(client)
    assert m[("gpu", "a", "acme")] + m[("others", "a", "acme")] == 12
    assert m[("gpu", "a", "globex")] == 12
    assert m.get(("own", "a", "acme"), 0) == 0
    assert ("gpu", "b", "acme") not in m or m[("gpu", "b", "acme")] == 0

    # acme's own prompts evicting its own blocks count as its own
    for i in range(80, 86):
        replicas["a"].serve(_prompt(i), salt)
    wait_until(lambda: _tenant_metrics(client).get(("own", "a", "acme"), 0) > 0)


def test_the_tally_attributes_evictions_by_whose_stores_came_with_them():
    tally = TenantTally()
    for h in range(4):
        tally.added(h, "acme")
    tally.added(99, None)  # unscoped: not counted
    tally.end_batch()
    tally.removed(0)
    tally.removed(1)
    tally.added(10, "globex")
    tally.end_batch()  # acme's blocks went with globex's stores only: by others
    tally.removed(2)
    tally.added(11, "acme")
    tally.added(12, "globex")
    tally.end_batch()  # acme stored too: its own
    tally.removed(3)
    tally.end_batch()  # nothing stored: its own (an engine cleaning up)
    rows = tally.snapshot()
    assert rows["acme"] == (1, 2, 2) and rows["globex"] == (2, 0, 0)
    tally.clear()
    assert tally.snapshot()["acme"] == (0, 2, 2)  # the counters outlive a cleared replica
    assert tenant_of("tenant:acme:x") == "acme" and tenant_of("acme") is None
    assert tenant_of(None) is None and tenant_of("tenant:") is None


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ([1], "expected a mapping of tenant to blocks"),
        ({"acme": 0}, "expected a positive number of GPU blocks per replica"),
        ({"a:b": 3}, "expected a tenant name"),
        ({"acme": True}, "expected a positive number"),
    ],
)
def test_bad_tenant_shares_are_refused(tmp_path, shares, message):
    from prefixcache.errors import ConfigError
    from prefixcache.fleet.service.configuration.config_file import parse_config

    data = {
        "routing": {"tenant_shares": shares},
        "replicas": [{"name": "a", "model": MODEL, "block_size": BLOCK}],
    }
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "t.yaml", tmp_path)
