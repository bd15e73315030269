"""GPU profiles: a GPU's peak figures and the roofline efficiencies measured on it, as JSON.

``prefixcache calibrate`` writes one; ``prefixcache replay --gpu-profile FILE`` times the serving
simulation with it instead of a built-in GPU. The file::

    {
      "schema": "prefixcache.gpu_profile", "schema_version": 1,
      "name": "h200",
      "peak_flops": 989e12, "hbm_bytes_per_s": 4.8e12, "memory_bytes": 150754820096,
      "compute_efficiency": 0.62, "memory_efficiency": 0.9, "step_overhead_s": 0.002,
      "attention_efficiency": 0.6, "context_attention_efficiency": 0.2,
      "calibration": {...}
    }

``memory_bytes``, ``attention_efficiency`` and ``context_attention_efficiency`` are optional;
``calibration`` (what was measured and how well the fit predicts it) is kept but not read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.replay.model_specs import EFFICIENCY_FIELDS, GpuConfig

SCHEMA = "prefixcache.gpu_profile"
SCHEMA_VERSION = 1
_REQUIRED = (
    "name",
    "peak_flops",
    "hbm_bytes_per_s",
    "compute_efficiency",
    "memory_efficiency",
    "step_overhead_s",
)
_OPTIONAL = ("memory_bytes", "attention_efficiency", "context_attention_efficiency")


@dataclass(frozen=True)
class GpuProfile:
    """A GPU and the roofline efficiencies fitted on it."""

    name: str
    peak_flops: float  # FLOP/s the efficiencies are fractions of
    hbm_bytes_per_s: float  # bytes/s the bandwidth efficiency is a fraction of
    compute_efficiency: float  # dense layers (MFU)
    memory_efficiency: float  # HBM bandwidth
    step_overhead_s: float
    memory_bytes: int | None = None
    attention_efficiency: float | None = None  # attention among a step's new tokens
    context_attention_efficiency: float | None = None  # attention over cached K/V
    calibration: dict[str, Any] = field(default_factory=dict, compare=False)

    def gpu_config(self) -> GpuConfig:
        """The GPU the serving roofline runs with."""
        return GpuConfig(
            self.name,
            self.peak_flops,
            self.hbm_bytes_per_s,
            self.memory_bytes,
            **{f: getattr(self, f) for f in EFFICIENCY_FIELDS},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (optional fields left out when unset)."""
        out: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "calibration":
                if value:
                    out[f.name] = value
            elif value is not None:
                out[f.name] = value
        return out


def write_profile(profile: GpuProfile, path: Path) -> None:
    """Write ``profile`` as JSON to ``path`` (replacing it whole)."""
    from prefixcache.atomic_files import atomic_open

    with atomic_open(path) as f:
        f.write(json.dumps(profile.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path) -> GpuProfile:
    """Read and check a profile file; ConfigError says what is wrong."""
    where = f"GPU profile {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    return profile_from_dict(doc, where)


def profile_from_dict(doc: Any, where: str = "GPU profile") -> GpuProfile:
    """A profile from its JSON document, checked field by field."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ConfigError(f"{where}: not a GPU profile (schema must be {SCHEMA!r})")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(
            f"{where}: schema_version {doc.get('schema_version')!r} is not {SCHEMA_VERSION}"
        )
    missing = [f for f in _REQUIRED if f not in doc]
    if missing:
        raise ConfigError(f"{where}: lacks {', '.join(missing)}")
    known = {"schema", "schema_version", "calibration", *_REQUIRED, *_OPTIONAL}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: name must be a non-empty string")
    memory = doc.get("memory_bytes")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)):
        raise ConfigError(f"{where}: memory_bytes must be an integer, got {memory!r}")
    if memory is not None and memory < 1:
        raise ConfigError(f"{where}: memory_bytes must be positive, got {memory!r}")
    calibration = doc.get("calibration", {})
    if not isinstance(calibration, dict):
        raise ConfigError(f"{where}: calibration must be an object")
    rates = {k: _number(doc[k], k, where, positive=True) for k in ("peak_flops", "hbm_bytes_per_s")}
    effs = {
        k: _efficiency(doc[k], k, where)
        for k in ("compute_efficiency", "memory_efficiency", *_OPTIONAL[1:])
        if doc.get(k) is not None
    }
    overhead = _number(doc["step_overhead_s"], "step_overhead_s", where, positive=False)
    return GpuProfile(
        name=name.strip(),
        memory_bytes=memory,
        step_overhead_s=overhead,
        calibration=calibration,
        **rates,
        **effs,
    )


def _number(value: Any, key: str, where: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        sign = "positive" if positive else "non-negative"
        raise ConfigError(f"{where}: {key} must be {sign}, got {value!r}")
    return float(value)


def _efficiency(value: Any, key: str, where: str) -> float:
    v = _number(value, key, where, positive=True)
    if v > 1:
        raise ConfigError(f"{where}: {key} is a fraction of the peak, in (0, 1], got {value!r}")
    return v
