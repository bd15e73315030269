"""Namespaces: what must be equal, besides the tokens, for two blocks to hold the same K/V."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Namespace:
    """Model, adapter and tenant identity. Blocks never match across namespaces.

    ``extra`` carries further keys that change the K/V of the same token ids, e.g. content hashes
    of images in a multimodal prompt.
    """

    model: str = ""
    adapter: str | None = None
    adapter_version: str | None = None
    salt: str | None = None
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise TypeError(f"Namespace.model must be a str, got {type(self.model).__name__}")
        for name in ("adapter", "adapter_version", "salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Namespace.{name} must be a str or None, got {value!r}")
        if not isinstance(self.extra, tuple) or not all(isinstance(x, str) for x in self.extra):
            raise TypeError(f"Namespace.extra must be a tuple of str, got {self.extra!r}")

    def canonical_bytes(self) -> bytes:
        """A stable encoding (same on every process and machine) that seeds the hash chain."""
        fields = [self.model, self.adapter, self.adapter_version, self.salt, list(self.extra)]
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()

    def label(self) -> str:
        """A short human-readable name for reports."""
        parts = [self.model or "default"]
        if self.adapter:
            parts.append(
                f"lora={self.adapter}"
                + (f"@{self.adapter_version}" if self.adapter_version else "")
            )
        if self.salt:
            parts.append(f"salt={self.salt}")
        if self.extra:
            parts.append("extra=" + ",".join(self.extra))
        return " ".join(parts)


DEFAULT_NAMESPACE = Namespace()
