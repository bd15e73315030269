"""A tokenizer that counts the characters it is given: how much text a cache had tokenized."""

from __future__ import annotations

import numpy as np

from prefixcache.text.tokenizers import HFTokenizer


class Counting:
    """A tokenizer that counts the characters it is given."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.name = inner.name
        self.special_wrap = inner.special_wrap
        self.splits_at_lone_spaces = inner.splits_at_lone_spaces
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_many(texts)
