"""The vLLM launcher without vLLM: its command line and environment, and its process handling
against a stand-in server (a real HTTP server in a process group of four processes, as one vLLM
server is): waited for on ``/health``, an exit or a deadline reported with the log's tail, and
every process of the group gone after ``stop``. The real servers: ``tests/engines/vllm_fleet``.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from prefixcache.engines.vllm import (
    ServerStartError,
    VLLMFleet,
    VLLMInstall,
    VLLMServerSpec,
    vllm_missing_reason,
)
from prefixcache.engines.vllm.install import env_problem, model_problem
from prefixcache.engines.vllm.launcher import (
    _group_members,
    server_command,
    server_environment,
)
from prefixcache.errors import ConfigError

STAND_IN = textwrap.dedent(
    """
    import http.server, os, subprocess, sys
    args = sys.argv[1:]
    mode = os.environ.get("STAND_IN_MODE", "serve")
    print("stand-in started with", " ".join(args), flush=True)
    if mode == "exit":
        print("boom: no such model", flush=True)
        sys.exit(3)
    for _ in range(3):  # an engine core, a worker, a resource tracker
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if mode == "hang":
        import time; time.sleep(600)
    port = int(args[args.index("--port") + 1])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path: Path) -> VLLMInstall:
    """An install whose interpreter runs the stand-in server, whatever module it is asked for."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return VLLMInstall(tmp_path / "env", python, tmp_path / "model")


def test_a_server_is_waited_for_and_its_whole_group_stopped(
    stand_in: VLLMInstall, tmp_path: Path
) -> None:
    spec = VLLMServerSpec("v0", cpu=sorted(os.sched_getaffinity(0))[0])
    with VLLMFleet([spec], log_dir=tmp_path / "logs", install=stand_in) as fleet:
        server = fleet["v0"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        group = server.pid
        members = _group_members(group)
        assert len(members) == 4, members  # the server and its three children
        assert os.sched_getaffinity(server.pid) == {spec.cpu}
    assert _group_members(group) == []
    assert "stand-in started with" in (tmp_path / "logs" / "v0.log").read_text()


def test_a_server_that_exits_is_reported_with_its_log(
    stand_in: VLLMInstall, tmp_path: Path
) -> None:
    spec = VLLMServerSpec("v0", extra_env={"STAND_IN_MODE": "exit"})
    fleet = VLLMFleet([spec], log_dir=tmp_path, install=stand_in)
    with pytest.raises(ServerStartError, match=r"(?s)exited with status 3.*boom: no such model"):
        fleet.start()
    assert fleet.servers == {}


def test_a_server_past_its_deadline_is_stopped_and_reported(
    stand_in: VLLMInstall, tmp_path: Path
) -> None:
    spec = VLLMServerSpec("v0", extra_env={"STAND_IN_MODE": "hang"})
    fleet = VLLMFleet([spec], log_dir=tmp_path, install=stand_in, startup_timeout_s=2.0)
    with pytest.raises(ServerStartError, match=r"(?s)did not answer /health.*stand-in started"):
        fleet.start()
    log = (tmp_path / "v0.log").read_text()
    assert "--port" in log and fleet.servers == {}


def test_a_restart_keeps_the_ports(stand_in: VLLMInstall, tmp_path: Path) -> None:
    spec = VLLMServerSpec("v0", events="tcp://127.0.0.1:5999")
    with VLLMFleet([spec], log_dir=tmp_path, install=stand_in) as fleet:
        before = fleet["v0"]
        after = fleet.restart("v0")
        assert (after.port, after.replay) == (before.port, before.replay)
        assert after.pid != before.pid and _group_members(before.pid) == []


def test_the_command_line_and_environment(stand_in: VLLMInstall, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/with/a/kernels/folder")
    spec = VLLMServerSpec(
        "v0",
        block_size=64,
        events="tcp://127.0.0.1:5557",
        hash_algo="sha256_cbor",
        api_key="sk-upstream",
        cpu=1,
    )
    cmd = server_command(stand_in, spec, 8100, 5558)
    assert cmd[:3] == [str(stand_in.python), "-m", "vllm.entrypoints.openai.api_server"]

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--block-size") == "64" and flag("--host") == "127.0.0.1"
    assert flag("--prefix-caching-hash-algo") == "sha256_cbor"
    assert flag("--api-key") == "sk-upstream" and flag("--port") == "8100"
    assert "--enable-prompt-tokens-details" in cmd and "--enable-prefix-caching" in cmd
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://127.0.0.1:5557"  # vLLM connects: the service binds
    assert events["replay_endpoint"] == "tcp://127.0.0.1:5558"
    env = server_environment(stand_in, spec)
    assert "PYTHONHASHSEED" not in env  # unset, as vLLM runs by default
    assert "PYTHONPATH" not in env and env["PYTHONSAFEPATH"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1" and "VLLM_SERVER_DEV_MODE" not in env
    seeded = server_environment(stand_in, VLLMServerSpec("v1", hash_seed="0", dev_mode=True))
    assert seeded["PYTHONHASHSEED"] == "0" and seeded["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--kv-events-config" not in server_command(stand_in, VLLMServerSpec("v1"), 1, None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"block_size": 16}, "multiple of 32"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"events": "localhost:5557"}, "ZMQ endpoint"),
    ],
)
def test_bad_specs_are_refused(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        VLLMServerSpec("v0", **spec)
    with pytest.raises(ConfigError, match="letters, digits"):
        VLLMServerSpec("a b")


def test_a_missing_environment_names_the_make_target(tmp_path: Path) -> None:
    assert env_problem(tmp_path / "nothing") == f"no virtualenv at {tmp_path / 'nothing'}"
    assert model_problem(tmp_path) == f"no tiny model at {tmp_path}"
    reason = vllm_missing_reason(tmp_path / "nothing", tmp_path)
    assert reason is not None and "`make vllm-env`" in reason
