"""Choosing where a sweep runs: bad choices are one error line, before anything runs."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from prefixcache.cli import main

CHAT = Path(__file__).resolve().parent / "golden" / "chat_small.yaml"


def run_cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def test_a_ray_address_needs_the_ray_executor(tmp_path: Path) -> None:
    code, err = run_cli(
        "replay", str(CHAT), "--blocks", "100", "--ray-address", "auto", "--out", str(tmp_path)
    )
    assert code == 2
    assert err == "prefixcache replay: error: --ray-address needs --executor ray\n"


def test_the_ray_executor_without_ray_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    code, err = run_cli(
        "replay", str(CHAT), "--blocks", "100,200", "--executor", "ray", "--out", str(tmp_path)
    )
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'prefixcache[ray]'" in err
