"""Tokenizing text whose beginning was tokenized before: the token ids of a prompt's leading text
are taken from a cache, and only the rest goes through the tokenizer.

Prompts share their beginnings (a system prompt, a document, the earlier turns of a
conversation, which the chat template renders as a prefix of the next turn's text), and the
tokenizer's time grows with the text: 2,000 words take 1-2 ms, on the path of every request a
router forwards. ``PrefixTokenizer`` cuts a text into segments at fixed places (the first space at
or after every ``segment_chars`` characters), keys each segment by a chained hash of the text up
to its end, and keeps each segment's token ids; a later text with the same beginning reuses the
segments it shares, and tokenizes the rest in one batch call.

Joining segments' token ids is exact only where no token spans the cut: true of tokenizers that
split words at spaces before their model runs (WordLevel, WordPiece, BPE with a ByteLevel or a
splitting Metaspace pre-tokenizer, Llama 3's and GPT-4's split patterns), not of every tokenizer
(a normalizer that prepends or strips, a model that merges across spaces). So nothing is
assumed: at each cut used, the text around it (``window_chars`` each side) is tokenized whole and
in its two halves, and the cut is used only when both agree. A text whose cuts do not agree is
tokenized whole; after ``DISAGREEMENTS_TO_STOP`` such texts in a row the cache turns itself off
(the tokenizer merges across spaces), and every text is tokenized whole, as before.

The cache holds at most ``max_tokens`` token ids (least recently used segments go first) and is
safe to call from several threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Protocol

import numpy as np
import xxhash

from prefixcache.text.tokenizers import SpecialTokenWrap

DISAGREEMENTS_TO_STOP = 8


class BatchTokenizer(Protocol):
    """What ``PrefixTokenizer`` needs of a tokenizer (``HFTokenizer`` has it)."""

    name: str
    special_wrap: SpecialTokenWrap | None  # what it adds around every text; None: not fixed

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The token ids of ``text`` (with its special tokens when ``add_special_tokens``)."""
        ...

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each of ``texts``, in one call."""
        ...


class PrefixTokenizerStats(NamedTuple):
    """What the cache saved so far."""

    texts: int  # texts encoded
    reused_chars: int  # characters whose token ids came from the cache
    tokenized_chars: int  # characters that went through the tokenizer
    whole: int  # texts tokenized whole because a cut did not agree
    enabled: bool


def _cuts(text: str, every: int) -> list[int]:
    """Where ``text`` is cut: before the first lone space (between two characters that are not
    whitespace, where pre-tokenizers split) at or after each multiple of ``every``."""
    cuts = []
    at = every
    end = len(text) - 1
    while at < end:
        c = text.find(" ", at)
        while 0 < c < end and (text[c - 1].isspace() or text[c + 1].isspace()):
            c = text.find(" ", c + 1)  # in a run of whitespace: on to the next space
        if c < 0 or c >= end:
            break
        cuts.append(c)
        at = c + every
    return cuts


class PrefixTokenizer:
    """``encode`` as ``tokenizer``'s, reusing the token ids of texts' leading segments."""

    def __init__(
        self,
        tokenizer: BatchTokenizer,
        *,
        segment_chars: int = 2048,
        window_chars: int = 256,
        max_tokens: int = 4_000_000,
    ) -> None:
        if segment_chars < 2 * window_chars:
            raise ValueError("segment_chars must be at least twice window_chars")
        self.tokenizer = tokenizer
        self.name = tokenizer.name
        self.segment_chars = segment_chars
        self.window_chars = window_chars
        self.max_tokens = max_tokens
        self._segments: OrderedDict[bytes, np.ndarray] = OrderedDict()  # key -> its token ids
        self._held = 0  # token ids held
        self._lock = threading.Lock()
        self._disagreed = 0  # texts in a row whose cuts did not agree
        self._enabled = True
        self._texts = self._reused = self._tokenized = self._whole = 0

    def stats(self) -> PrefixTokenizerStats:
        """The texts encoded so far, the characters reused and tokenized, and whether the cache
        is on."""
        return PrefixTokenizerStats(
            self._texts, self._reused, self._tokenized, self._whole, self._enabled
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The token ids of ``text``, as the tokenizer gives them (with the special tokens it
        adds to a prompt when ``add_special_tokens``: its fixed wrap around the reused ids, or,
        for a tokenizer without one, the whole text through it)."""
        if not add_special_tokens:
            return self._plain(text)
        wrap = self.tokenizer.special_wrap
        if wrap is None:
            self._texts += 1
            self._tokenized += len(text)
            return self.tokenizer.encode(text, add_special_tokens=True)
        return wrap.around(self._plain(text))

    def _plain(self, text: str) -> np.ndarray:
        """The token ids of ``text`` without special tokens."""
        self._texts += 1
        cuts = _cuts(text, self.segment_chars) if self._enabled else []
        if not cuts:
            self._tokenized += len(text)
            return self.tokenizer.encode(text)
        bounds = [0, *cuts, len(text)]
        keys = []
        key = b""
        for i in range(len(cuts)):  # the text up to each cut, chained
            key = xxhash.xxh3_128_digest(key + text[bounds[i] : bounds[i + 1]].encode())
            keys.append(key)
        with self._lock:
            cached: list[np.ndarray] = []
            for key in keys:  # the leading segments held
                ids = self._segments.get(key)
                if ids is None:
                    break
                self._segments.move_to_end(key)
                cached.append(ids)
        reused = len(cached)  # segments 0 .. reused-1 come from the cache
        pieces = [text[bounds[i] : bounds[i + 1]] for i in range(reused, len(bounds) - 1)]
        checked = cuts[max(0, reused - 1) :] if reused else cuts  # cuts joining ids anew
        w = self.window_chars
        windows = []
        for c in checked:
            left, right = text[max(0, c - w) : c], text[c : c + w]
            windows += [left, right, left + right]
        got = self.tokenizer.encode_many(pieces + windows)
        fresh, window_ids = got[: len(pieces)], got[len(pieces) :]
        for i in range(0, len(window_ids), 3):
            if window_ids[i] + window_ids[i + 1] != window_ids[i + 2]:
                return self._whole_text(text)
        self._disagreed = 0
        self._reused += bounds[reused]
        self._tokenized += len(text) - bounds[reused]
        new = [np.asarray(ids, dtype="<i4") for ids in fresh]
        self._keep(keys[reused:], new[: len(keys) - reused])
        return np.concatenate([*cached, *new]) if len(cached) + len(new) > 1 else new[0]

    def _whole_text(self, text: str) -> np.ndarray:
        """A text one of whose cuts splits a token: tokenized whole."""
        self._whole += 1
        self._tokenized += len(text)
        self._disagreed += 1
        if self._disagreed >= DISAGREEMENTS_TO_STOP:
            self._enabled = False  # the tokenizer merges across spaces
            with self._lock:
                self._segments.clear()
                self._held = 0
        return self.tokenizer.encode(text)

    def _keep(self, keys: list[bytes], segments: list[np.ndarray]) -> None:
        with self._lock:
            for key, ids in zip(keys, segments, strict=True):
                if key in self._segments:
                    continue
                self._segments[key] = ids
                self._held += len(ids)
            while self._held > self.max_tokens and self._segments:
                _, gone = self._segments.popitem(last=False)
                self._held -= len(gone)
