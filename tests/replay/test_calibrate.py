"""``prefixcache calibrate``: the CPU check mode end to end, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixcache.cli import main
from prefixcache.replay.calibrate.gpu_profile import load_profile

GOLDEN_CHAT = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"


def test_tiny_cpu_calibration_writes_a_profile_the_replay_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cpu.json"
    args = ["calibrate", "--device", "cpu", "--tiny", "--warmup", "1", "--repeats", "3"]
    code = main([*args, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"wrote {out}" in captured.out
    profile = load_profile(out)
    assert profile.name == "cpu"
    assert 0 < profile.compute_efficiency <= 1 and 0 < profile.memory_efficiency <= 1
    shapes = [(m["kind"], m["batch"]) for m in profile.calibration["measurements"]]
    assert shapes == [
        ("prefill", 1),
        ("prefill", 4),
        ("prefill", 1),
        ("extend", 1),
        ("decode", 8),
        ("decode", 1),
    ]
    assert profile.calibration["model"] == "tiny-random"
    run = tmp_path / "run"
    replay = ["replay", str(GOLDEN_CHAT), "--mode", "serving", "--blocks", "300"]
    assert main([*replay, "--gpu-profile", str(out), "--format", "json", "--out", str(run)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["serving"]["assumptions"]["compute_efficiency"] == profile.compute_efficiency
    assert report["config"]["gpu"] == "cpu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cpu"], "--device cpu runs only with --tiny"),
        (["--device", "cpu", "--tiny", "--repeats", "0"], "--repeats >= 1"),
        (["--device", "cpu", "--tiny", "--step-overhead", "-1"], "--step-overhead must be >= 0"),
    ],
)
def test_bad_calibrate_options(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_calibrate_without_cuda_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--model", "llama-3.1-8b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "prefixcache calibrate: error: no CUDA GPU found; calibrate times a real GPU (on CPU "
        "only --device cpu --tiny runs, as a check of the command)"
    ]
