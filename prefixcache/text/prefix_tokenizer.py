"""Tokenizing text whose beginning was tokenized before: the token ids of a prompt's leading text
are taken from a cache, and only the rest goes through the tokenizer.

Prompts share their beginnings (a system prompt, a document, the earlier turns of a
conversation, which the chat template renders as a prefix of the next turn's text), and the
tokenizer's time grows with the text: 2,000 words take 1-2 ms, on the path of every request a
router forwards. ``PrefixTokenizer`` cuts a text into segments at fixed places (before the first
lone space at or after every ``segment_chars`` characters), keys each segment by a chained hash
of the text up to its end, and keeps each segment's token ids; a later text with the same
beginning reuses the segments it shares, and tokenizes the rest in one batch call.

The text after the last cut (its tail) is kept too, keyed the same way, with its length noted
where it begins: a later text that continues it (the next turn of a conversation, an agent's
prompt grown by a tool's answer) reuses it and tokenizes only what follows, and a text seen
before in full (a retry, the same prompt for several samples) is not tokenized at all.

Joining token ids is exact only where no token spans the join: true of tokenizers that split
words at spaces before their model runs (WordLevel, WordPiece, BPE with a ByteLevel or a
splitting Metaspace pre-tokenizer, Llama 3's and GPT-4's split patterns), not of every tokenizer
(a normalizer that prepends or strips, a model that merges across spaces). A tokenizer whose
``tokenizer.json`` shows that its tokens never span a lone space (``splits_at_lone_spaces``, the
rules in ``space_splits``) has its joins at lone spaces used as they are: every cut is one, and
so is the end of a text that a later one continues with a space and a word. Every other join
made anew is checked: the text around it (``window_chars`` each side) is tokenized whole and in
its two halves, and the join is used only when both agree. A kept tail that does not join (it
ended inside what is now a longer word) is left out and the text read again without it. A text
whose cuts do not agree is tokenized whole; after ``DISAGREEMENTS_TO_STOP`` such texts in a row
the cache turns itself off (the tokenizer merges across spaces), and every text is tokenized
whole, as before.

``encode_within`` encodes a text only when little of it is left to tokenize (a caller on an event
loop hands the rest to a thread); ``held`` only when nothing is.

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
TAILS_PER_PLACE = 4  # the tail lengths noted where tails begin, the least recently used go first
TAIL_PLACES = 1 << 15  # the most places noted (least recently used go first)


class BatchTokenizer(Protocol):
    """What ``PrefixTokenizer`` needs of a tokenizer (``HFTokenizer`` has it)."""

    name: str
    special_wrap: SpecialTokenWrap | None  # what it adds around every text; None: not fixed
    splits_at_lone_spaces: bool  # its tokens never span a lone space (``space_splits``)

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


class _Tail(NamedTuple):
    """A kept tail that the text continues: its length in characters and its ids."""

    chars: int
    ids: np.ndarray


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


def _lone_space(text: str, at: int) -> bool:
    """Whether ``text[at]`` is a space between two characters that are not whitespace."""
    return (
        0 < at < len(text) - 1
        and text[at] == " "
        and not text[at - 1].isspace()
        and not text[at + 1].isspace()
    )


def _key(place: bytes, piece: str) -> bytes:
    """The key of ``piece`` following the text whose key is ``place`` (b"": the start)."""
    return xxhash.xxh3_128_digest(place + piece.encode())


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
        self._tails: OrderedDict[bytes, list[int]] = OrderedDict()  # place -> tail lengths
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
        ids = self._encode(text, add_special_tokens, None)
        assert ids is not None  # no limit: always encoded
        return ids

    def encode_within(
        self, text: str, add_special_tokens: bool = False, max_chars: int = 0
    ) -> np.ndarray | None:
        """``encode(text, add_special_tokens)`` when at most ``max_chars`` characters of it go
        through the tokenizer (the text around a join to check counted), else None, with nothing
        tokenized: what is left when the ids of what was seen before are reused."""
        return self._encode(text, add_special_tokens, max_chars)

    def held(self, text: str, add_special_tokens: bool = False) -> np.ndarray | None:
        """``encode(text, add_special_tokens)`` when every one of its ids is in the cache (the
        text was seen before in full), without calling the tokenizer; else None."""
        return self._encode(text, add_special_tokens, 0)

    def _encode(
        self, text: str, add_special_tokens: bool, max_chars: int | None
    ) -> np.ndarray | None:
        if not add_special_tokens:
            return self._plain(text, max_chars)
        wrap = self.tokenizer.special_wrap
        if wrap is None:  # the whole text through the tokenizer
            if max_chars is not None and len(text) > max_chars:
                return None
            self._texts += 1
            self._tokenized += len(text)
            return self.tokenizer.encode(text, add_special_tokens=True)
        ids = self._plain(text, max_chars)
        return None if ids is None else wrap.around(ids)

    def _plain(self, text: str, max_chars: int | None) -> np.ndarray | None:
        """The token ids of ``text`` without special tokens (None when more than ``max_chars``
        would be tokenized)."""
        if not self._enabled:
            if max_chars is not None and len(text) > max_chars:
                return None
            self._texts += 1
            self._tokenized += len(text)
            return self.tokenizer.encode(text)
        cuts = _cuts(text, self.segment_chars)
        bounds = [0, *cuts, len(text)]
        keys = self._keys(text, bounds)
        with self._lock:
            cached, tail = self._found(text, bounds, keys)
        if max_chars is not None and self._cost(text, bounds, cached, tail) > max_chars:
            return None
        ids = self._read(text, bounds, keys, cached, tail)
        if ids is None and tail is not None:  # the tail ended inside a longer word: without it
            if max_chars is not None and self._cost(text, bounds, cached, None) > max_chars:
                return None
            ids = self._read(text, bounds, keys, cached, None)
        if ids is None:
            if max_chars is not None:
                return None  # left to a caller without a limit, which tokenizes it whole
            ids = self._whole_text(text)
        else:
            self._disagreed = 0
        self._texts += 1
        return ids

    @staticmethod
    def _keys(text: str, bounds: list[int]) -> list[bytes]:
        """The chained key of the text up to each cut."""
        keys = []
        key = b""
        for i in range(len(bounds) - 2):
            key = _key(key, text[bounds[i] : bounds[i + 1]])
            keys.append(key)
        return keys

    def _found(
        self, text: str, bounds: list[int], keys: list[bytes]
    ) -> tuple[list[np.ndarray], _Tail | None]:
        """The leading segments held, and the longest kept tail the text continues after them
        (not past its next cut). Called with the lock held."""
        cached: list[np.ndarray] = []
        for key in keys:
            ids = self._segments.get(key)
            if ids is None:
                break
            self._segments.move_to_end(key)
            cached.append(ids)
        place = keys[len(cached) - 1] if cached else b""
        start = bounds[len(cached)]
        room = bounds[len(cached) + 1] - start
        tried = [room] if start + room == len(text) else []  # the rest as a kept tail: a repeat
        tried += sorted((n for n in self._tails.get(place, ()) if n < room), reverse=True)
        for chars in tried:
            if chars == 0:
                continue
            key = _key(place, text[start : start + chars])
            ids = self._segments.get(key)
            if ids is not None:
                self._segments.move_to_end(key)
                lengths = self._tails.get(place)
                if lengths is not None and chars in lengths:  # used: the last to go
                    lengths.remove(chars)
                    lengths.append(chars)
                    self._tails.move_to_end(place)
                return cached, _Tail(chars, ids)
        return cached, None

    def _read(
        self,
        text: str,
        bounds: list[int],
        keys: list[bytes],
        cached: list[np.ndarray],
        tail: _Tail | None,
    ) -> np.ndarray | None:
        """The ids of ``text``: ``cached`` segments, then ``tail``, then the rest through the
        tokenizer, each new join checked; None when a join does not agree."""
        reused = len(cached)
        at = bounds[reused] + (tail.chars if tail is not None else 0)  # tokenized from here
        before = [tail.ids] if tail is not None else []
        if at == len(text):  # seen before in full
            self._reused += len(text)
            return self._joined(cached, before)
        pieces = [text[at : bounds[reused + 1]]]
        pieces += [text[bounds[i] : bounds[i + 1]] for i in range(reused + 1, len(bounds) - 1)]
        w = self.window_chars
        windows = []
        for c in self._checked_joins(text, bounds, reused, at):
            left, right = text[max(0, c - w) : c], text[c : c + w]
            windows += [left, right, left + right]
        got = self.tokenizer.encode_many(pieces + windows)
        fresh, window_ids = got[: len(pieces)], got[len(pieces) :]
        for i in range(0, len(window_ids), 3):
            if window_ids[i] + window_ids[i + 1] != window_ids[i + 2]:
                return None
        self._reused += at
        self._tokenized += len(text) - at
        new = [np.asarray(ids, dtype="<i4") for ids in fresh]
        if before:  # the segment (or tail) the kept tail begins is the tail and what follows
            new[0] = np.concatenate([*before, new[0]])
        # new[k] is the text from bounds[reused + k]: segments up to the last cut, then the tail
        place = keys[-1] if keys else b""
        tail_text = text[bounds[-2] :]
        self._keep(keys[reused:], new[:-1], place, _key(place, tail_text), len(tail_text), new[-1])
        return self._joined(cached, new)

    def _checked_joins(self, text: str, bounds: list[int], reused: int, at: int) -> list[int]:
        """Where ids tokenized anew (from ``at`` on) meet others and the text around must be
        checked: every such join, or, for a tokenizer whose tokens never span a lone space,
        those not at one."""
        joins = ([at] if at > 0 else []) + bounds[reused + 1 : -1]
        if self.tokenizer.splits_at_lone_spaces:
            return [c for c in joins if not _lone_space(text, c)]
        return joins

    def _cost(
        self, text: str, bounds: list[int], cached: list[np.ndarray], tail: _Tail | None
    ) -> int:
        """The characters ``_read`` gives the tokenizer for ``text``: what follows the reused
        ids, and the text around each join it checks."""
        reused = len(cached)
        at = bounds[reused] + (tail.chars if tail is not None else 0)
        if at == len(text):
            return 0
        w = self.window_chars
        cost = len(text) - at
        for c in self._checked_joins(text, bounds, reused, at):
            cost += 2 * (min(w, c) + min(w, len(text) - c))
        return cost

    @staticmethod
    def _joined(cached: list[np.ndarray], rest: list[np.ndarray]) -> np.ndarray:
        parts = [*cached, *rest]
        if len(parts) > 1:
            return np.concatenate(parts)
        return parts[0] if parts else np.empty(0, dtype="<i4")

    def _whole_text(self, text: str) -> np.ndarray:
        """A text one of whose cuts splits a token: tokenized whole."""
        self._whole += 1
        self._tokenized += len(text)
        self._disagreed += 1
        if self._disagreed >= DISAGREEMENTS_TO_STOP:
            self._enabled = False  # the tokenizer merges across spaces
            with self._lock:
                self._segments.clear()
                self._tails.clear()
                self._held = 0
        return self.tokenizer.encode(text)

    def _keep(
        self,
        keys: list[bytes],
        segments: list[np.ndarray],
        place: bytes,
        tail_key: bytes,
        tail_chars: int,
        tail_ids: np.ndarray,
    ) -> None:
        """Keep new segments, and the text's tail (``tail_chars`` long, after ``place``, where
        its last segment ends) with its length noted there."""
        with self._lock:
            for key, ids in zip(keys, segments, strict=True):
                self._put(key, ids)
            if tail_chars > 0:
                self._put(tail_key, tail_ids)
                lengths = self._tails.get(place)
                if lengths is None:
                    lengths = self._tails[place] = []
                    if len(self._tails) > TAIL_PLACES:
                        self._tails.popitem(last=False)
                else:
                    self._tails.move_to_end(place)
                if tail_chars in lengths:
                    lengths.remove(tail_chars)
                lengths.append(tail_chars)
                del lengths[:-TAILS_PER_PLACE]
            while self._held > self.max_tokens and self._segments:
                _, gone = self._segments.popitem(last=False)
                self._held -= len(gone)

    def _put(self, key: bytes, ids: np.ndarray) -> None:
        if key not in self._segments:
            self._segments[key] = ids
            self._held += len(ids)
