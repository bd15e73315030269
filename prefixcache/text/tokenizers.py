"""Tokenizers for text prompts: a dependency-free byte-level one, or a Hugging Face
``tokenizers`` JSON file (needs the ``tokenizers`` package, imported only then), and the neutral
chat rendering used when no chat template is given.

The replay reads text traces through these, and the fleet service tokenizes prompts with the
same ones, so both see the same token ids for the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from prefixcache.errors import ConfigError


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: deterministic, no vocabulary file, one token per byte."""

    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<i4")


class HFTokenizer:
    """A ``tokenizer.json`` as written by Hugging Face ``tokenizers`` / ``transformers``."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ConfigError(
                f"reading {path} needs the 'tokenizers' package (pip install tokenizers); "
                "without it, omit --tokenizer to use the byte-level tokenizer"
            ) from None
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ConfigError(f"{path}: not a tokenizers JSON file ({exc})") from None
        self.name = Path(path).name

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype="<i4")


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    if path is None or str(path) in ("", "bytes"):
        return ByteTokenizer()
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer file {path} does not exist")
    return HFTokenizer(path)


def render_chat(messages: list[dict[str, str]]) -> str:
    """A neutral chat rendering (role tag, content) so equal conversations give equal tokens."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
