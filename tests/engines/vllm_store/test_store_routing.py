"""Behind ``prefixcache serve``: a prefix computed on one real vLLM server is in reach of the
other through their shared store, and the router sends a new request there when the first is
busy, as ``prefix_cost`` documents (fewest tokens to prefill plus in-flight prompt tokens, then
most cached on GPU).

Both servers run the store connector on one LMDB store and publish KV events to the service,
configured with ``kv_store: shm`` each: the connector's ``STORE`` events put the blocks one
server wrote under the store, counted as cached for both.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx
from store_support import checkout_import_path, complete, store_server

from prefixcache.engines.vllm.launcher import VLLMFleet, free_port
from tests.engines.vllm_fleet.real_fleet import (
    HTTP_TIMEOUT_S,
    MODEL,
    random_tokens,
    serving,
    wait_for,
)

PROMPT = 2000


def test_a_busy_replica_sends_its_prefix_to_the_one_that_loads_it_from_the_store(
    tmp_path_factory,
):
    tmp = tmp_path_factory.mktemp("store-routing")
    path = Path("/dev/shm") / f"prefixcache-test-{uuid.uuid4().hex[:12]}"
    url = f"lmdb://{path}?capacity={64 << 20}"
    import_path = checkout_import_path(tmp / "path")
    specs = [
        store_server(name, cpu, url, import_path, events=f"tcp://127.0.0.1:{free_port()}")
        for cpu, name in enumerate(("a", "b"))
    ]
    try:
        with VLLMFleet(specs, log_dir=tmp / "logs") as fleet:
            servers = [fleet["a"], fleet["b"]]
            shared = {s.name: {"kv_store": "shm"} for s in servers}
            model = fleet.install.model if fleet.install is not None else None
            assert model is not None
            with serving(tmp / "serve", servers, model, replica_overrides=shared) as service:
                service.wait_probed(["a", "b"])
                _check_routing(service, fleet)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _check_routing(service, fleet) -> None:
    prefix = random_tokens(PROMPT)
    first, cached = service.proxied(prefix, max_tokens=4)
    assert cached == 0
    other = "b" if first == "a" else "a"
    # the index learns the prefix on the first replica's GPU, and in the store from its
    # STORE events: in reach of both
    wait_for(
        lambda: min(service.lookup(prefix).values()) >= PROMPT // 32 * 32,
        "the prefix in reach of both replicas (the first's GPU, the store)",
    )
    # the first replica gets a request of that prefix in flight (a route counted as load
    # until released): with equal cached tokens, the GPU holder wins the tie
    busy_prompt = prefix + random_tokens(300)
    routed = httpx.post(
        f"{service.url}/v1/route",
        json={"model": MODEL, "tokens": busy_prompt, "request_id": "busy-1"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert routed.status_code == 200, routed.text
    assert routed.json()["replica"] == first
    # now a new request of the prefix goes to the other replica, which loads it from the store
    tokens = prefix + random_tokens(200)
    replica, cached = service.proxied(tokens, max_tokens=8)
    assert replica == other
    assert cached >= 0.9 * PROMPT
    # and answers what the replica that holds the prefix itself answers
    here = complete(fleet[other].url, tokens)
    there = complete(fleet[first].url, tokens)
    assert here.text == there.text
    released = httpx.post(
        f"{service.url}/v1/release", json={"request_id": "busy-1"}, timeout=HTTP_TIMEOUT_S
    )
    assert released.status_code == 200, released.text
