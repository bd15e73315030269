"""GPU profiles: the fit to the H200 measurements, the file format and ``replay --gpu-profile``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.errors import ConfigError
from prefixcache.replay.calibrate.gpu_profile import GpuProfile, load_profile, write_profile
from prefixcache.replay.calibrate.profile_fit import Measurement, fit_profile, residuals
from prefixcache.replay.model_specs import GpuConfig, get_gpu, get_model

# A random-weight Llama-3.1-8B-shaped model in bf16 on one H200: flash SDPA for fresh prefill,
# the paged kernel for extend, eager decode.
H200_MEASUREMENTS = (
    Measurement("prefill", 1, 8192, 0, 0.220),
    Measurement("prefill", 8, 1024, 0, 0.196),
    Measurement("prefill", 1, 2048, 0, 0.050),
    Measurement("extend", 1, 1024, 7168, 0.045),
    Measurement("decode", 64, 1, 2048, 0.0097),
    Measurement("decode", 1, 1, 8192, 0.0094),
)
H200_REFERENCE = GpuConfig("h200", 989e12, 4.8e12, 150754820096)
TOLERANCE = 0.15


def _fit_h200() -> GpuProfile:
    return fit_profile(H200_MEASUREMENTS, get_model("llama-3.1-8b"), H200_REFERENCE)


def test_fit_reproduces_the_h200_measurements() -> None:
    profile = _fit_h200()
    got = {
        (r.measurement.kind, r.measurement.batch): r.ratio
        for r in residuals(profile, get_model("llama-3.1-8b"), H200_MEASUREMENTS)
    }
    launch_bound = ("decode", 1)  # eager single-sequence decode: kernel launches, not bytes
    for shape, ratio in got.items():
        if shape != launch_bound:
            assert abs(ratio - 1) <= TOLERANCE, (shape, ratio)
    # the worst shape: the roofline predicts the bytes (about 6 ms), the eager run took 9.4 ms
    worst = min(got, key=lambda s: got[s])
    assert worst == launch_bound
    assert 0.55 < got[launch_bound] < 0.75


def test_shipped_h200_numbers_are_the_fit() -> None:
    profile = _fit_h200()
    shipped = get_gpu("h200")
    assert shipped.efficiencies() == {
        "compute_efficiency": profile.compute_efficiency,
        "memory_efficiency": profile.memory_efficiency,
        "step_overhead_s": profile.step_overhead_s,
        "attention_efficiency": profile.attention_efficiency,
        "context_attention_efficiency": profile.context_attention_efficiency,
    }
    assert profile.context_attention_efficiency is not None
    assert profile.attention_efficiency is not None
    # the paged extend kernel is slower per FLOP than flash attention on fresh prompts
    assert profile.context_attention_efficiency < profile.attention_efficiency


def test_fit_merges_attention_terms_without_an_extend_shape() -> None:
    fresh = [m for m in H200_MEASUREMENTS if m.kind != "extend"]
    profile = fit_profile(fresh, get_model("llama-3.1-8b"), H200_REFERENCE)
    assert profile.context_attention_efficiency is None
    assert 0 < profile.compute_efficiency <= 1


def test_fit_rejects_what_it_cannot_fit() -> None:
    model = get_model("llama-3.1-8b")
    with pytest.raises(ConfigError, match="decode"):
        fit_profile(H200_MEASUREMENTS[:3], model, H200_REFERENCE)
    with pytest.raises(ConfigError, match="step overhead"):
        fit_profile(
            [*H200_MEASUREMENTS, Measurement("decode", 1, 1, 8, 1e-3)], model, H200_REFERENCE
        )
    slow = GpuConfig("slow", 1e12, 1e11)
    with pytest.raises(ConfigError, match="too low"):
        fit_profile(H200_MEASUREMENTS, model, slow)


def test_a_measured_reference_is_raised_to_what_the_shapes_reached() -> None:
    """A measured peak or bandwidth is only a lower bound: beaten, it is raised, not refused."""
    model = get_model("llama-3.1-8b")
    slow = GpuConfig("measured", 1e12, 1e11)
    profile = fit_profile(H200_MEASUREMENTS, model, slow, reference_is_lower_bound=True)
    assert profile.peak_flops > slow.peak_flops and profile.hbm_bytes_per_s > slow.hbm_bytes_per_s
    assert 0 < profile.compute_efficiency <= 1 and 0 < profile.memory_efficiency <= 1
    assert profile.calibration["raised_peak_flops"] == pytest.approx(profile.peak_flops, 1e-3)
    assert "raised_bytes_per_s" in profile.calibration


def test_profile_round_trip(tmp_path: Path) -> None:
    profile = _fit_h200()
    path = tmp_path / "h200.json"
    write_profile(profile, path)
    back = load_profile(path)
    assert back == profile
    assert back.calibration["measurements"][0]["kind"] == "prefill"
    assert back.gpu_config().efficiencies() == get_gpu("h200").efficiencies()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": "x"}, "not a GPU profile"),
        ({"compute_efficiency": 1.5}, r"in \(0, 1\]"),
        ({"memory_efficiency": "high"}, "must be a number"),
        ({"peak_flops": 0}, "must be positive"),
        ({"step_overhead_s": -1}, "non-negative"),
        ({"mfu": 0.5}, "unknown field 'mfu'"),
        ({"schema_version": 2}, "schema_version"),
    ],
)
def test_bad_profiles_are_refused(tmp_path: Path, change: dict[str, object], message: str) -> None:
    doc = _fit_h200().to_dict() | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        load_profile(path)


def _replay(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "replay",
        str(Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"),
        "--mode",
        "serving",
        "--blocks",
        "300",
        "--format",
        "json",
        "--out",
        str(tmp_path / "run"),
        *extra,
    ]


def test_replay_uses_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = GpuProfile(
        "my-gpu", 500e12, 2e12, compute_efficiency=0.4, memory_efficiency=0.7, step_overhead_s=0.001
    )
    path = tmp_path / "p.json"
    write_profile(profile, path)
    assert main(_replay(tmp_path, "--gpu-profile", str(path))) == 0
    report = json.loads(capsys.readouterr().out)
    assumed = report["serving"]["assumptions"]
    assert assumed["gpu"] == "my-gpu"
    assert assumed["compute_efficiency"] == 0.4
    assert assumed["memory_efficiency"] == 0.7
    assert assumed["step_overhead_s"] == 0.001
    assert report["config"]["gpu_profile"] == str(path)


def test_replay_refuses_a_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text("{}")
    assert main(_replay(tmp_path, "--gpu-profile", str(path))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"prefixcache replay: error: GPU profile {path}: not a GPU profile "
        "(schema must be 'prefixcache.gpu_profile')"
    ]
