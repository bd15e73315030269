"""Namespaces: what must be equal, besides the tokens, for two blocks to hold the same K/V."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from prefixcache.errors import InvalidArgumentError

_PLAIN = re.compile(r"[A-Za-z0-9._:/+-]+")  # label values shown without quotes


def _encode(value: str | None) -> bytes:
    """None, or a length-prefixed strict UTF-8 string: no two values encode alike."""
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")  # strict: lone surrogates were rejected on construction
    return b"\x01" + len(data).to_bytes(4, "little") + data


def _shown(value: str) -> str:
    return value if _PLAIN.fullmatch(value) and value != "default" else json.dumps(value)


@dataclass(frozen=True)
class Namespace:
    """Model, adapter and tenant identity. Blocks never match across namespaces.

    ``extra`` carries further keys that change the K/V of the same token ids, e.g. content hashes
    of images in a multimodal prompt. ``weights`` names the exact weights behind ``model`` (a
    revision such as a Hugging Face commit, or ``store.weights_fingerprint`` of the tensors):
    runtimes that serve one model name with other weights then never share a block.
    """

    model: str = ""
    adapter: str | None = None
    adapter_version: str | None = None
    salt: str | None = None
    extra: tuple[str, ...] = ()
    weights: str | None = None

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]  # set in __post_init__, not a field

    def __reduce__(self) -> tuple[type[Namespace], tuple[object, ...]]:
        # rebuilt through __init__: str hashes differ between processes
        fields = (self.model, self.adapter, self.adapter_version, self.salt, self.extra)
        if self.weights is not None:
            return type(self), (*fields, self.weights)
        return type(self), fields

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise InvalidArgumentError(
                f"Namespace.model must be a str, got {type(self.model).__name__}"
            )
        for name in ("adapter", "adapter_version", "salt", "weights"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"Namespace.{name} must be a str or None, got {value!r}")
        if not isinstance(self.extra, tuple) or not all(isinstance(x, str) for x in self.extra):
            raise InvalidArgumentError(
                f"Namespace.extra must be a tuple of str, got {self.extra!r}"
            )
        values = (self.model, self.adapter, self.adapter_version, self.salt, self.weights)
        for value in (*values, *self.extra):
            if value is not None:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidArgumentError(
                        f"Namespace fields must be valid Unicode text, got {value!r} "
                        "(a lone surrogate)"
                    ) from None
        key = (self.model, self.adapter, self.adapter_version, self.salt, self.extra, self.weights)
        object.__setattr__(self, "_hash", hash(key))

    def canonical_bytes(self) -> bytes:
        """The encoding that seeds the hash chain: the same on every process and machine, and
        injective (two namespaces that differ in any field never encode alike). Each field is a
        presence byte then a 4-byte length and its UTF-8 bytes; ``extra`` is prefixed by its
        count. ``weights``, when set, follows as the tag ``w`` and its encoding; unset, nothing
        follows, so every namespace without it (and every digest seeded by one) encodes as it
        did before the field existed: the fields before end where they always ended, so a
        tail can only be the tag's."""
        parts = [_encode(self.model), _encode(self.adapter), _encode(self.adapter_version)]
        parts.append(_encode(self.salt))
        parts.append(len(self.extra).to_bytes(4, "little"))
        parts.extend(_encode(x) for x in self.extra)
        if self.weights is not None:
            parts.append(b"w" + _encode(self.weights))
        return b"".join(parts)

    def label(self) -> str:
        """A short human-readable name for reports; distinct namespaces get distinct labels.

        Values outside ``[A-Za-z0-9._:/+-]`` (or empty) are shown JSON-quoted.
        """
        parts = [_shown(self.model) if self.model else "default"]
        version = self.adapter_version
        if self.adapter is not None:
            at = "" if version is None else f"@{_shown(version)}"
            parts.append(f"lora={_shown(self.adapter)}{at}")
        elif version is not None:
            parts.append(f"version={_shown(version)}")
        if self.salt is not None:
            parts.append(f"salt={_shown(self.salt)}")
        if self.extra:
            if all(_PLAIN.fullmatch(x) for x in self.extra):
                parts.append("extra=" + ",".join(self.extra))
            else:
                parts.append("extra=" + json.dumps(list(self.extra)))
        if self.weights is not None:
            parts.append(f"weights={_shown(self.weights)}")
        return " ".join(parts)


DEFAULT_NAMESPACE = Namespace()
