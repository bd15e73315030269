"""Fit the serving roofline's efficiencies to measured step times.

Per regime, with the per-step overhead ``o`` fixed (a CUDA-graph runtime's scheduling and
sampling, not an eager model's kernel launches):

* prefill and extend are compute-bound: ``t - o = F / (P e_c) + A_new / (P e_a) + A_ctx / (P e_x)``
  with F the dense FLOPs (layers and lm_head), A_new the attention FLOPs among the new tokens and
  A_ctx those over cached K/V. Least squares on the relative error gives the MFU ``e_c``, the
  attention efficiency ``e_a`` and the context (paged) attention efficiency ``e_x``; with too few
  shapes, or a non-physical result (an efficiency outside (0, 1]), the attention terms are merged,
  then folded into ``e_c``.
* decode is bandwidth-bound: ``t - o = bytes / (B e_m)``, from the decode shape moving the most
  bytes (small decode batches are launch-bound in eager mode and would understate ``e_m``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from prefixcache.errors import ConfigError
from prefixcache.replay.calibrate.gpu_profile import GpuProfile
from prefixcache.replay.model_specs import GpuConfig, ModelConfig
from prefixcache.replay.sim.roofline import Roofline, context_pairs, prefill_pairs

KINDS = ("prefill", "extend", "decode")
DEFAULT_STEP_OVERHEAD_S = 2e-3


class Measurement(NamedTuple):
    """One timed forward pass: ``batch`` sequences, each computing ``new_tokens`` after
    ``context`` cached ones (decode: one new token)."""

    kind: str  # prefill, extend or decode
    batch: int
    new_tokens: int
    context: int
    seconds: float


class Residual(NamedTuple):
    """How a profile's roofline predicts one measurement."""

    measurement: Measurement
    predicted_s: float

    @property
    def ratio(self) -> float:
        """Predicted over measured time (1.0: exact; above 1: the roofline is too slow)."""
        return self.predicted_s / self.measurement.seconds


class _Work(NamedTuple):
    tokens: int
    pairs: int
    kv_read: int
    logits: int
    context_pairs: int


def _work(m: Measurement) -> _Work:
    b, n, c = m.batch, m.new_tokens, m.context
    return _Work(b * n, b * prefill_pairs(c, n), b * (c + n), b, b * context_pairs(c, n))


def predict_seconds(profile: GpuProfile, model: ModelConfig, m: Measurement) -> float:
    """The serving roofline's step time for one measured shape under ``profile``."""
    roof = Roofline.for_gpu(model, profile.gpu_config())
    return roof.step_seconds(*_work(m))


def residuals(
    profile: GpuProfile, model: ModelConfig, measurements: Sequence[Measurement]
) -> list[Residual]:
    """The profile's prediction for every measurement."""
    return [Residual(m, predict_seconds(profile, model, m)) for m in measurements]


def fit_profile(
    measurements: Sequence[Measurement],
    model: ModelConfig,
    reference: GpuConfig,
    *,
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
    calibration: dict[str, Any] | None = None,
    reference_is_lower_bound: bool = False,
) -> GpuProfile:
    """Efficiencies relative to ``reference``'s peak FLOP/s and bandwidth that make the roofline
    reproduce ``measurements`` of ``model`` (see the module docstring); ConfigError when the
    measurements cannot be fitted. ``calibration`` is stored in the profile along with the fit's
    residuals.

    ``reference_is_lower_bound``: the reference figures were measured (one matmul, one copy),
    so a shape that beat them raises them to what it achieved (noted in ``calibration``)
    instead of failing; a datasheet reference is never changed."""
    _check(measurements, step_overhead_s)
    compute = [m for m in measurements if m.kind != "decode"]
    decode = [m for m in measurements if m.kind == "decode"]
    if not compute or not decode:
        raise ConfigError("fitting a profile needs prefill (or extend) and decode measurements")
    cal = dict(calibration or {})
    effs, peak = _fit_compute(
        compute, model, reference.peak_flops, step_overhead_s, reference_is_lower_bound
    )
    if peak != reference.peak_flops:
        cal["raised_peak_flops"] = _round(peak)
    traffic = {m: model.weight_bytes + model.kv_bytes_per_token * _work(m).kv_read for m in decode}
    widest = max(decode, key=lambda m: traffic[m])
    bandwidth = reference.hbm_bytes_per_s
    memory_eff = traffic[widest] / (bandwidth * (widest.seconds - step_overhead_s))
    if memory_eff > 1 and reference_is_lower_bound:
        bandwidth *= memory_eff
        memory_eff = 1.0
        cal["raised_bytes_per_s"] = _round(bandwidth)
    if memory_eff > 1:
        raise ConfigError(
            f"decode moved {traffic[widest] / 1e9:.1f} GB faster than {reference.name}'s "
            f"{reference.hbm_bytes_per_s / 1e12:.2f} TB/s; the reference bandwidth is too low"
        )
    profile = GpuProfile(
        name=reference.name,
        peak_flops=peak,
        hbm_bytes_per_s=bandwidth,
        memory_bytes=reference.memory_bytes,
        memory_efficiency=_round(memory_eff),
        step_overhead_s=step_overhead_s,
        compute_efficiency=effs["compute_efficiency"],
        attention_efficiency=effs.get("attention_efficiency"),
        context_attention_efficiency=effs.get("context_attention_efficiency"),
    )
    fit = [
        {**r.measurement._asdict(), "predicted_s": _round(r.predicted_s), "ratio": _round(r.ratio)}
        for r in residuals(profile, model, measurements)
    ]
    return replace(profile, calibration={**cal, "model": model.name, "measurements": fit})


def _check(measurements: Sequence[Measurement], overhead: float) -> None:
    if not overhead >= 0:
        raise ConfigError(f"step overhead must be non-negative, got {overhead!r}")
    for m in measurements:
        if m.kind not in KINDS:
            raise ConfigError(f"unknown measurement kind {m.kind!r}; one of {', '.join(KINDS)}")
        if m.batch < 1 or m.new_tokens < 1 or m.context < 0:
            raise ConfigError(f"bad measured shape {m}")
        if m.kind == "decode" and m.new_tokens != 1:
            raise ConfigError(f"a decode step computes one token per sequence, got {m}")
        if not m.seconds > overhead:
            raise ConfigError(
                f"{m.kind} {m.batch}x{m.new_tokens} took {m.seconds:.3g} s, not more than the "
                f"step overhead of {overhead:.3g} s"
            )


def _fit_compute(
    measurements: Sequence[Measurement],
    model: ModelConfig,
    peak: float,
    overhead: float,
    raise_peak: bool,
) -> tuple[dict[str, float], float]:
    """Least squares on relative error for the compute-bound efficiencies, and the peak they
    are fractions of (``peak``, or with ``raise_peak`` the rate a shape reached above it)."""
    pair = model.attention_flops_per_pair
    dense, fresh, ctx = [], [], []
    for m in measurements:
        w = _work(m)
        dense.append(2.0 * model.layer_flops_params * w.tokens + model.lm_head_flops * w.logits)
        fresh.append(pair * (w.pairs - w.context_pairs))
        ctx.append(pair * w.context_pairs)
    target = np.array([m.seconds - overhead for m in measurements])
    d, f, c = np.array(dense), np.array(fresh), np.array(ctx)
    names = ("compute_efficiency", "attention_efficiency", "context_attention_efficiency")
    candidates: list[tuple[list[np.ndarray], tuple[str, ...]]] = []
    if c.any():
        candidates.append(([d, f, c], names))
    candidates.append(([d, f + c], names[:2]))
    candidates.append(([d + f + c], names[:1]))
    fallback = None
    for columns, keys in candidates:
        if len(measurements) < len(columns):
            continue
        x = np.stack(columns, axis=1) / target[:, None]
        coef, *_ = np.linalg.lstsq(x, np.ones(len(target)), rcond=None)
        if (coef <= 0).any():
            continue
        effs = 1.0 / (peak * coef)
        if (effs <= 1).all():
            return {k: _round(float(e)) for k, e in zip(keys, effs, strict=True)}, peak
        fallback = fallback or (keys, effs)
    if raise_peak and fallback is not None:  # the measured peak was beaten: it is at least this
        keys, effs = fallback
        top = float(effs.max())
        return {k: _round(float(e) / top) for k, e in zip(keys, effs, strict=True)}, peak * top
    raise ConfigError(
        f"prefill ran faster than {peak / 1e12:.0f} TFLOP/s allows; the reference peak is too low"
    )


def _round(x: float) -> float:
    return float(f"{x:.4g}")
