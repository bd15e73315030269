"""Model and GPU configurations: KV bytes per block for sizing, FLOPs and bytes for timing.

A table of well-known models ships in ``prefixcache/data/models.json``; ``--model`` also takes a
JSON or YAML file with one model (the same fields) or a Hugging Face ``config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
_FIELDS = ("params", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    params: int  # total parameters (weight bytes)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"  # weights
    kv_dtype: str | None = None  # KV cache; the weights' dtype when None
    active_params: int | None = None  # per token, for mixture-of-experts models
    hf_id: str | None = None
    vocab_size: int | None = None  # with hidden_size: the embedding and lm_head shapes
    hidden_size: int | None = None
    tie_word_embeddings: bool = False  # lm_head shares the embedding's weights
    intermediate_size: int | None = None  # MLP width (what ``prefixcache calibrate`` builds)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        kv = DTYPE_BYTES[self.kv_dtype or self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv

    def bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    @property
    def weight_bytes(self) -> int:
        return self.params * DTYPE_BYTES[self.dtype]

    @property
    def flops_params(self) -> int:
        """Parameters a token passes through, embedding and lm_head included."""
        return self.active_params or self.params

    @property
    def embedding_params(self) -> int:
        """Parameters of the embedding table and lm_head (one table when tied); 0 if unknown."""
        if self.vocab_size is None or self.hidden_size is None:
            return 0
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def layer_flops_params(self) -> int:
        """Parameters every computed token multiplies through: the transformer layers. The
        embedding is a table lookup (no FLOPs); lm_head is counted per sampled position."""
        return self.flops_params - self.embedding_params

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the logits of one position (2 x hidden x vocab); 0 if the shapes are unknown."""
        if self.vocab_size is None or self.hidden_size is None:
            return 0
        return 2 * self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token attending one key (QK and AV, every layer and head)."""
        return 4 * self.num_layers * self.num_attention_heads * self.head_dim


DEFAULT_COMPUTE_EFFICIENCY = 0.5  # achieved fraction of peak FLOPs without a fitted profile


@dataclass(frozen=True)
class GpuConfig:
    """A GPU's datasheet figures and, when measured, the roofline's efficiencies on it (None:
    the roofline's defaults)."""

    name: str
    peak_flops: float  # dense BF16, one GPU
    hbm_bytes_per_s: float
    memory_bytes: int | None = None  # HBM capacity, one GPU
    compute_efficiency: float | None = None  # achieved fraction of peak FLOPs (MFU)
    memory_efficiency: float | None = None  # achieved fraction of HBM bandwidth
    step_overhead_s: float | None = None  # fixed seconds per step
    attention_efficiency: float | None = None  # MFU of attention among a step's new tokens
    context_attention_efficiency: float | None = None  # MFU of attention over cached K/V

    def efficiencies(self) -> dict[str, float]:
        """The efficiencies and overhead this GPU sets (the rest stay the roofline's)."""
        return {f: v for f in EFFICIENCY_FIELDS if (v := getattr(self, f)) is not None}


EFFICIENCY_FIELDS = (
    "compute_efficiency",
    "memory_efficiency",
    "step_overhead_s",
    "attention_efficiency",
    "context_attention_efficiency",
)


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    text = resources.files("prefixcache").joinpath("data/models.json").read_text("utf-8")
    return json.loads(text)


def model_names() -> list[str]:
    return sorted(_table()["models"])


def gpu_names() -> list[str]:
    return sorted(_table()["gpus"])


def get_model(name_or_path: str) -> ModelConfig:
    """A model from the table (by name or Hugging Face id, any case) or from a file."""
    path = Path(name_or_path)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.is_file():
        return _model_from_file(path)
    key = name_or_path.lower()
    for name, entry in _table()["models"].items():
        hf = entry.get("hf_id", "").lower()
        if key in (name, hf, hf.rsplit("/", 1)[-1]):
            return _model(name, entry, "the models table")
    raise ConfigError(
        f"unknown model {name_or_path!r}; choose one of {', '.join(model_names())} "
        "or pass a JSON/YAML file with params, num_layers, num_attention_heads, num_kv_heads, "
        "head_dim (or a Hugging Face config.json)"
    )


def get_gpu(name: str) -> GpuConfig:
    entry = _table()["gpus"].get(name.lower())
    if entry is None:
        raise ConfigError(f"unknown GPU {name!r}; choose one of {', '.join(gpu_names())}")
    memory = entry.get("memory_bytes")
    return GpuConfig(
        name.lower(),
        float(entry["peak_flops"]),
        float(entry["hbm_bytes_per_s"]),
        int(memory) if memory is not None else None,
        **{f: float(entry[f]) for f in EFFICIENCY_FIELDS if entry.get(f) is not None},
    )


def _model(name: str, entry: Any, origin: str) -> ModelConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"{origin}: model {name!r} must be a mapping")
    missing = [f for f in _FIELDS if f not in entry]
    if missing:
        raise ConfigError(f"{origin}: model {name!r} lacks {', '.join(missing)}")
    try:
        cfg = ModelConfig(
            name=str(entry.get("name", name)),
            **{f: _positive_int(entry[f], f, origin) for f in _FIELDS},
            dtype=str(entry.get("dtype", "bfloat16")),
            kv_dtype=entry.get("kv_dtype"),
            active_params=None
            if entry.get("active_params") is None
            else _positive_int(entry["active_params"], "active_params", origin),
            hf_id=entry.get("hf_id"),
            vocab_size=None
            if entry.get("vocab_size") is None
            else _positive_int(entry["vocab_size"], "vocab_size", origin),
            hidden_size=None
            if entry.get("hidden_size") is None
            else _positive_int(entry["hidden_size"], "hidden_size", origin),
            tie_word_embeddings=bool(entry.get("tie_word_embeddings", False)),
            intermediate_size=None
            if entry.get("intermediate_size") is None
            else _positive_int(entry["intermediate_size"], "intermediate_size", origin),
        )
    except TypeError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    for dt in (cfg.dtype, cfg.kv_dtype):
        if dt is not None and dt not in DTYPE_BYTES:
            raise ConfigError(f"{origin}: unknown dtype {dt!r}; one of {', '.join(DTYPE_BYTES)}")
    return cfg


def _positive_int(value: Any, field: str, origin: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{origin}: {field} must be a positive integer, got {value!r}")
    return value


def _model_from_file(path: Path) -> ModelConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"model file {path}: {exc.strerror}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError or yaml.YAMLError
        raise ConfigError(f"model file {path}: cannot parse ({exc})") from None
    if isinstance(doc, dict) and "num_hidden_layers" in doc:
        return _from_hf_config(doc, path)
    return _model(path.stem, doc, f"model file {path}")


def _from_hf_config(c: dict[str, Any], path: Path) -> ModelConfig:
    """A Hugging Face config.json; the parameter count is estimated from the shapes."""
    try:
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model file {path}: Hugging Face config lacks {exc}") from None
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    experts = int(c.get("num_local_experts") or 1)
    active_experts = int(c.get("num_experts_per_tok") or 1)
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    params = embed + layers * (attn + experts * mlp + 2 * hidden)
    active = embed + layers * (attn + active_experts * mlp + 2 * hidden)
    dtype = str(c.get("torch_dtype") or "bfloat16")
    name = str(c.get("_name_or_path") or path.parent.name or path.stem)
    return _model(
        name,
        {
            "params": params,
            "num_layers": layers,
            "num_attention_heads": heads,
            "num_kv_heads": kv,
            "head_dim": head_dim,
            "dtype": dtype,
            "active_params": active if experts > 1 else None,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "tie_word_embeddings": bool(c.get("tie_word_embeddings")),
            "intermediate_size": inter,
        },
        f"model file {path}",
    )


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``40GiB``, ``1.5 TB``, ``512MiB`` or a plain number of bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 40GiB, 80GB or 512MiB")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit in ("", "b"):
        return int(value)
    base = 1024 if "i" in unit else 1000
    power = "kmgtp".index(unit[0]) + 1
    return int(value * base**power)
