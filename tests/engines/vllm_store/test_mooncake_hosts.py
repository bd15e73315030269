"""Two real vLLM servers share prefixes through Mooncake Store as two hosts would: one master,
and each server a client on its own address (``local_hostname`` 127.0.0.1 and 127.0.0.2, where
its transfer engine listens), so a block one server wrote is read over the transfer engine from
the other's memory.
The master killed and restarted empty: the servers keep answering the same tokens, count the
failures, and share prefixes again once it is back.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from store_support import (
    checkout_import_path,
    complete,
    prompt,
    store_counters,
    store_server,
    vllm_install,
    wait_for_counter,
)

from prefixcache.engines.vllm.launcher import VLLMFleet
from tests.store.mooncake_master import MooncakeMaster

BLOCK = 32
PROMPT = 2000
HOSTS = {"a": "127.0.0.1", "b": "127.0.0.2"}


def _mooncake_missing() -> str | None:
    python = vllm_install().python
    probe = "from mooncake.store import MooncakeDistributedStore"
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode != 0:
        return (
            "Mooncake Store's client does not load in vLLM's virtualenv (pip install "
            "mooncake-transfer-engine-non-cuda there; apt-get install -y libibverbs1 librdmacm1 "
            "libnuma1)"
        )
    try:
        import mooncake  # noqa: F401  # the master binary ships with the client
    except ImportError as exc:
        return f"Mooncake's master is not installed here (pip install '.[mooncake]'): {exc}"
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _mooncake_missing()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("mooncake-pair")
    master = MooncakeMaster(tmp)
    master.start()
    import_path = checkout_import_path(tmp / "path")
    specs = []
    for cpu, (name, host) in enumerate(HOSTS.items()):
        url = (
            f"mooncake://127.0.0.1:{master.rpc}?metadata=http://127.0.0.1:{master.http}/metadata"
            f"&local_hostname={host}&segment=64&buffer=16"
        )
        env = {"MC_LOG_LEVEL": "ERROR"}  # the client binds its transfer engine to local_hostname
        specs.append(store_server(name, cpu, url, import_path, env=env))
    try:
        with VLLMFleet(specs, log_dir=Path(tmp) / "logs") as fleet:
            yield fleet["a"].url, fleet["b"].url, master
    finally:
        master.stop()


def served_on_a(a: str, tokens: list[int]):
    before = store_counters(a).get("written_blocks", 0.0)
    cold = complete(a, tokens)
    assert cold.cached_tokens == 0
    wait_for_counter(a, "written_blocks", before + len(tokens) // BLOCK)
    return cold


def test_the_second_host_loads_the_first_hosts_prefix(hosts):
    a, b, _ = hosts
    tokens = prompt(PROMPT, 21)
    cold = served_on_a(a, tokens)
    warm = complete(b, tokens)
    assert warm.cached_tokens >= 0.9 * PROMPT
    assert warm.text == cold.text


def test_a_master_killed_and_restarted_empty(hosts):
    a, b, master = hosts
    master.kill()
    tokens = prompt(PROMPT, 22)
    cold = complete(a, tokens)
    before = store_counters(b)
    warm = complete(b, tokens)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 0
    assert warm.text == cold.text
    wait_for_counter(b, "query_errors", before.get("query_errors", 0) + 1)

    master.start()  # empty, on the same ports
    for seed in range(30, 60):  # until the clients are back (each is left alone 2 s)
        tokens = prompt(PROMPT, seed)
        written = store_counters(a).get("written_blocks", 0.0)
        cold = complete(a, tokens)
        try:
            wait_for_counter(a, "written_blocks", written + PROMPT // BLOCK, timeout_s=10)
        except AssertionError:
            continue
        warm = complete(b, tokens)
        if warm.cached_tokens:  # b's own client may still be left alone for a moment
            assert warm.cached_tokens >= 0.9 * PROMPT
            assert warm.text == cold.text
            return
        assert warm.text == cold.text
    raise AssertionError(f"no prefix shared after the master came back: {store_counters(a)}")
