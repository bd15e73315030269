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
    """What the replay and the service need of a tokenizer: a ``name`` (for reports and logs)
    and ``encode``."""

    name: str

    def encode(self, text: str) -> np.ndarray:
        """The token ids of ``text`` as a 1-D int32 array, no special tokens added."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: deterministic, no vocabulary file, one token per byte."""

    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as a new int32 array (empty for empty text)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<i4")


class HFTokenizer:
    """A ``tokenizer.json`` as written by Hugging Face ``tokenizers`` / ``transformers``, read
    from ``path``; ``name`` is the file's name. Raises ConfigError when the ``tokenizers``
    package is not installed or the file is not a tokenizer it can read."""

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
        self._fast = getattr(self._tok, "encode_batch_fast", None)

    def encode(self, text: str) -> np.ndarray:
        """The token ids of ``text`` as an int32 array, without the special tokens the
        tokenizer would add (a chat template writes its own). The same ids as ``encode``'s,
        about half the time: no offsets are tracked (``encode_batch_fast``, where the
        ``tokenizers`` release has it)."""
        return np.asarray(self.encode_many([text])[0], dtype="<i4")

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each of ``texts`` (as ``encode``), in one call."""
        if self._fast is not None:
            return [e.ids for e in self._fast(texts, add_special_tokens=False)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The byte-level tokenizer for None, ``""`` or ``"bytes"``, else the Hugging Face one in
    file ``path``. Raises ConfigError when the file does not exist or cannot be read as one
    (or ``tokenizers`` is not installed)."""
    if path is None or str(path) in ("", "bytes"):
        return ByteTokenizer()
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer file {path} does not exist")
    return HFTokenizer(path)


def render_chat(messages: list[dict[str, str]]) -> str:
    """A neutral chat rendering, ``<|role|>`` then the content on its own line, message after
    message, so equal conversations give equal tokens. Each message needs ``role`` and
    ``content`` keys (a missing one raises KeyError); nothing else is read."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
