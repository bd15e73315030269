"""Tokenizers for text prompts: a dependency-free byte-level one, or a Hugging Face
``tokenizers`` JSON file (needs the ``tokenizers`` package, imported only then), and the neutral
chat rendering used when no chat template is given.

The replay reads text traces through these, and the fleet service tokenizes prompts with the
same ones, so both see the same token ids for the same text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from prefixcache.errors import ConfigError
from prefixcache.text.space_splits import splits_at_lone_spaces


class Tokenizer(Protocol):
    """What the replay and the service need of a tokenizer: a ``name`` (for reports and logs)
    and ``encode``."""

    name: str

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The token ids of ``text`` as a 1-D int32 array; with ``add_special_tokens``, with
        the special tokens the tokenizer puts around a prompt (a BOS, for most models)."""
        ...


class SpecialTokenWrap(NamedTuple):
    """The special token ids a tokenizer puts before (``head``) and after (``tail``) every
    text it encodes with its special tokens."""

    head: tuple[int, ...]
    tail: tuple[int, ...]

    def around(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (int32) with the head before and the tail after, as a new int32 array."""
        if not self.head and not self.tail:
            return ids
        out = np.empty(len(self.head) + len(ids) + len(self.tail), dtype="<i4")
        out[: len(self.head)] = self.head
        out[len(self.head) : len(self.head) + len(ids)] = ids
        out[len(self.head) + len(ids) :] = self.tail
        return out


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: deterministic, no vocabulary file, one token per byte,
    no special tokens."""

    name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as a new int32 array (empty for empty text); there are
        no special tokens to add."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<i4")


class HFTokenizer:
    """A ``tokenizer.json`` as written by Hugging Face ``tokenizers`` / ``transformers``, read
    from ``path``; ``name`` is the file's name. Raises ConfigError when the ``tokenizers``
    package is not installed or the file is not a tokenizer it can read.

    ``special_wrap`` is what its post-processor adds around one text (``<s> $A``: a BOS before
    it), found by encoding probe texts with and without special tokens and kept only when
    every probe agrees: then a text's ids with special tokens are its plain ids wrapped, which
    lets the plain ids be reused (``PrefixTokenizer``). None when the additions are not the
    same around every text: such texts are encoded with their special tokens, whole.

    ``splits_at_lone_spaces``: whether its tokens never span a lone space, as its file shows
    (``space_splits``), so that ids of a text's parts cut there join without a check."""

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
        self.special_wrap = _special_wrap(self)
        self.splits_at_lone_spaces = splits_at_lone_spaces(json.loads(self._tok.to_str()))

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The token ids of ``text`` as an int32 array, with the special tokens the tokenizer
        adds to a prompt when ``add_special_tokens`` (as ``tokenizer(text)`` in transformers,
        which engines call on a text prompt), else without (a chat template writes its own).
        The same ids as ``tokenizers``' ``encode``, about half the time: no offsets are
        tracked (``encode_batch_fast``, where the ``tokenizers`` release has it)."""
        return np.asarray(self.encode_many([text], add_special_tokens)[0], dtype="<i4")

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """The token ids of each of ``texts`` (as ``encode``), in one call."""
        if self._fast is not None:
            return [e.ids for e in self._fast(texts, add_special_tokens=add_special_tokens)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]


# texts whose ids with and without special tokens show what a post-processor adds: one from
# which any tokenizer makes tokens, ones with spaces, digits and a line break, and the empty text
_WRAP_PROBES = ("a", "Hello, world 12", "\n x  y", "")


def _special_wrap(tokenizer: HFTokenizer) -> SpecialTokenWrap | None:
    """The special tokens ``tokenizer`` puts around every text, or None when the probes do not
    show one fixed wrap (or cannot be encoded)."""
    try:
        pairs = [
            (tokenizer.encode_many([p])[0], tokenizer.encode_many([p], True)[0])
            for p in _WRAP_PROBES
        ]
    except Exception:  # a vocabulary without an unknown token refuses the probes
        return None
    wrap = None
    for plain, full in pairs:  # the first probe whose plain ids sit in one place only
        extra = len(full) - len(plain)
        at = [k for k in range(extra + 1) if plain and full[k : k + len(plain)] == plain]
        if extra >= 0 and len(at) == 1:
            k = at[0]
            wrap = SpecialTokenWrap(tuple(full[:k]), tuple(full[k + len(plain) :]))
            break
    if wrap is None:
        return None
    for plain, full in pairs:
        if full != [*wrap.head, *plain, *wrap.tail]:
            return None
    return wrap


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
