"""Mooncake Store across "hosts" on loopback: a real master and client processes. The backend's
operations, two runtime processes sharing prefixes through it, and a master killed mid-run and
restarted empty while a runtime keeps serving the same tokens."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

from tests.store.mooncake_master import MooncakeMaster, client_error

pytestmark = pytest.mark.skipif(client_error() is not None, reason=str(client_error()))

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_runtime.py"


@pytest.fixture
def master(tmp_path):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    m = MooncakeMaster(tmp_path)
    m.start()
    yield m
    m.stop()


def _runtime():
    spec = importlib.util.spec_from_file_location("tiny_runtime_mooncake", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_put_exists_get_remove(master):
    from prefixcache.store.from_url import open_store

    store = open_store(master.url)
    try:
        a, b = bytes(range(16)), bytes(16)
        assert store.put_many([(a, b"x" * 4096)]) == 1
        assert store.exists([a, b]) == [True, False]
        out = memoryview(bytearray(8192))
        assert store.get_into(a, out) == 4096 and bytes(out[:4096]) == b"x" * 4096
        assert store.get_into(b, out) is None
        assert store.get_into(a, memoryview(bytearray(100))) == 4096  # too long: not copied
        store.remove(a)  # forced past the lease the reads took
        assert store.exists([a]) == [False]
        assert store.evicted() == 0
    finally:
        store.close()
    from prefixcache.store.backend import StoreUnavailableError

    with pytest.raises(StoreUnavailableError):  # closed: refused, never a crash
        store.exists([a])


def _serve(url: str, wrote, done, results) -> None:
    """One runtime process: serve the prompts through the store, report, and keep this
    process's segment (where its blocks live) up until told."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    rt = _runtime()
    from prefixcache.store.from_url import open_store

    store = open_store(url)
    out = rt.compare_store(store)
    results.put(out)
    wrote.set()
    done.wait(120)
    store.close()


def test_two_runtime_processes_share_prefixes_through_mooncake(master):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    done = ctx.Event()
    procs = []
    try:
        for _ in range(2):  # one after the other, both up: two hosts with a segment each
            wrote = ctx.Event()
            p = ctx.Process(target=_serve, args=(master.url, wrote, done, results))
            p.start()
            procs.append(p)
            assert wrote.wait(180), "a runtime process did not finish"
        first, second = results.get(timeout=10), results.get(timeout=10)
    finally:
        done.set()
        for p in procs:
            p.join(60)
    assert first["loaded_blocks"] == 0 and first["written_blocks"] > 0
    assert second["loaded_blocks"] > 0 and second["refused"] == {}
    alone = second["system_tokens_computed_alone"]
    assert alone > 0 and second["system_tokens_computed"] <= 0.1 * alone  # >= 90% fewer
    assert second["identical"] and second["max_logit_diff"] <= 1e-4


def test_a_killed_master_keeps_the_runtime_serving(master):
    rt = _runtime()
    from prefixcache.store.from_url import open_store

    store = open_store(master.url)
    try:
        first = rt.compare_store(store)
        assert first["written_blocks"] > 0
        master.kill()  # mid-run: every call now fails
        down = rt.compare_store(store)
        assert down["identical"] and down["max_logit_diff"] <= 1e-4
        assert down["loaded_blocks"] == 0 and down["query_errors"] > 0
        assert down["system_tokens_computed"] == down["system_tokens_computed_alone"]
        master.start()  # restarted empty: the client finds it again by itself
        import time

        deadline = time.monotonic() + 30
        while store._client.health_check() != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # the client's segment mounted again
        again = rt.compare_store(store)
        assert again["identical"] and again["loaded_blocks"] == 0
        assert again["written_blocks"] > 0  # the empty store is filled again
    finally:
        store.close()


def _host(url: str, address: str, role: str, wrote, done, results) -> None:
    """One runtime process on its own "host" (a loopback address of its own), run as a host
    would run it: no transfer-engine settings in its environment, its address in the URL."""
    os.environ.pop("MC_TCP_BIND_ADDRESS", None)
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    rt = _runtime()
    from prefixcache.store.from_url import open_store

    store = open_store(f"{url}&local_hostname={address}")
    results.put((role, rt.compare_store(store)))
    wrote.set()
    done.wait(120)
    store.close()


def test_a_runtime_on_another_host_loads_what_the_first_wrote(master):
    """Two hosts as 127.0.0.1 and 127.0.0.2: each registers its segment at its own address
    (the master lists both), and the second loads the blocks the first holds."""
    import json
    import urllib.request

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    done = ctx.Event()
    procs = []
    try:
        for address, role in (("127.0.0.1", "first"), ("127.0.0.2", "second")):
            wrote = ctx.Event()
            p = ctx.Process(target=_host, args=(master.url, address, role, wrote, done, results))
            p.start()
            procs.append(p)
            assert wrote.wait(180), f"the runtime on {address} did not finish"
        outs = dict(results.get(timeout=10) for _ in range(2))
        with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics}/get_segments_detail") as r:
            segments = json.loads(r.read())["segments"]
    finally:
        done.set()
        for p in procs:
            p.join(60)
    hosts = sorted(s["segment_name"].rsplit(":", 1)[0] for s in segments)
    assert hosts == ["127.0.0.1", "127.0.0.2"], segments
    first, second = outs["first"], outs["second"]
    assert first["written_blocks"] > 0
    assert second["loaded_blocks"] > 0 and second["refused"] == {}
    assert second["identical"] and second["max_logit_diff"] <= 1e-4


def test_the_segment_address_is_the_hosts_own():
    from prefixcache.errors import ConfigError
    from prefixcache.store.mooncake import MooncakeBlockStore, segment_address

    assert segment_address("127.0.0.1:50051", None) == "127.0.0.1"  # a master on this host
    assert segment_address("localhost:50051", None) == "127.0.0.1"
    assert segment_address("10.1.2.3:50051", "10.9.9.9") == "10.9.9.9"  # as given
    with pytest.raises(ConfigError, match=r"loopback.*local_hostname"):
        segment_address("10.1.2.3:50051", "127.0.0.1")  # other hosts cannot reach it
    with pytest.raises(ConfigError, match="loopback"):  # refused before joining the store
        MooncakeBlockStore(
            "198.51.100.7:50051", "http://198.51.100.7:8080/metadata", local_hostname="localhost"
        )
    try:  # a master elsewhere: the address this host reaches it from (no packet is sent)
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.7", 50051))
            expected = s.getsockname()[0]
    except OSError as exc:
        pytest.skip(f"this host has no route off loopback: {exc}")
    assert segment_address("198.51.100.7:50051", None) == expected
    assert not expected.startswith("127.")
