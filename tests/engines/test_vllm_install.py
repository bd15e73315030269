"""Adding the store integrations' packages to vLLM's virtualenv (``make vllm-env``), against a
stand-in interpreter that answers the import probe and records each ``pip install``: the
packages the connector needs are installed in one call, Mooncake Store's client on its own,
and a Mooncake client that cannot install leaves the rest installed and says why (its tests
then skip naming the reason) instead of failing the whole environment.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from prefixcache.engines.vllm import install
from prefixcache.engines.vllm.install import (
    OPTIONAL_STORE_PACKAGES,
    STORE_PACKAGES,
    add_store_packages,
)

STAND_IN = """\
import json, os, sys
calls = os.environ["STAND_IN_CALLS"]
if sys.argv[1] == "-c":  # the import probe: the modules named in STAND_IN_MISSING are absent
    asked = sys.argv[3:]
    print(" ".join(m for m in asked if m in os.environ["STAND_IN_MISSING"].split()))
    sys.exit(0)
args = sys.argv[3:]  # -m pip install -q ...
with open(calls, "a") as f:
    f.write(json.dumps(args) + "\\n")
fails = os.environ.get("STAND_IN_FAILS")
if fails and any(a.startswith(fails) for a in args):
    print("ERROR: No matching distribution found for " + args[-1], file=sys.stderr)
    sys.exit(1)
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls"))
    (tmp_path / "calls").write_text("")
    return tmp_path / "env"


def pip_calls(env: Path) -> list[list[str]]:
    text = (env.parent / "calls").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_everything_missing_is_installed_mooncake_on_its_own(env, monkeypatch):
    monkeypatch.setenv("STAND_IN_MISSING", " ".join([*STORE_PACKAGES, *OPTIONAL_STORE_PACKAGES]))
    added = add_store_packages(env)
    assert added.installed and added.unavailable == {}
    calls = pip_calls(env)
    assert calls == [
        ["install", "-q", *STORE_PACKAGES.values()],
        ["install", "-q", *OPTIONAL_STORE_PACKAGES.values()],
    ]


def test_a_mooncake_client_that_cannot_install_leaves_the_rest_installed(env, monkeypatch, capsys):
    monkeypatch.setenv("STAND_IN_MISSING", " ".join([*STORE_PACKAGES, *OPTIONAL_STORE_PACKAGES]))
    monkeypatch.setenv("STAND_IN_FAILS", "mooncake")
    added = add_store_packages(env)
    assert added.installed
    assert "No matching distribution" in added.unavailable["mooncake"]
    assert pip_calls(env)[0] == ["install", "-q", *STORE_PACKAGES.values()]


def test_the_command_says_what_could_not_install_and_succeeds(env, monkeypatch, capsys):
    monkeypatch.setenv("STAND_IN_MISSING", "mooncake")
    monkeypatch.setenv("STAND_IN_FAILS", "mooncake")
    monkeypatch.setattr(install, "env_problem", lambda env: None)
    monkeypatch.setattr(install, "write_model", lambda env, model: False)
    code = install.main(["--env", str(env), "--model", str(env.parent / "model")])
    out, err = capsys.readouterr()
    assert code == 0
    assert "Mooncake" in err and "skip" in err and "No matching distribution" in err
    state = json.loads(out.splitlines()[-1])
    assert state["store_packages_added"] is False and "mooncake" in state["unavailable"]


def test_a_required_package_that_cannot_install_fails_the_command(env, monkeypatch, capsys):
    monkeypatch.setenv("STAND_IN_MISSING", "lmdb")
    monkeypatch.setenv("STAND_IN_FAILS", "lmdb")
    monkeypatch.setattr(install, "env_problem", lambda env: None)
    code = install.main(["--env", str(env), "--model", str(env.parent / "model")])
    assert code == 1
    assert "error:" in capsys.readouterr().err


def test_nothing_missing_installs_nothing(env, monkeypatch):
    monkeypatch.setenv("STAND_IN_MISSING", "")
    added = add_store_packages(env)
    assert not added.installed and added.unavailable == {}
    assert pip_calls(env) == []
