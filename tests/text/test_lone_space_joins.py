"""Joins at lone spaces taken without a check are exact: for tokenizers of every family the rules
of ``space_splits`` admit (built here with ``tokenizers``: word-level, GPT-2's byte-level BPE with
and without a prefix space, Llama 3's and Qwen2's split patterns, SentencePiece-style Metaspace
with either prepend scheme, BERT's WordPiece with its normalizer, digits split first), every text
``PrefixTokenizer`` encodes, seen for the first time, repeated, or grown from any of its
beginnings (cut anywhere: inside words, between a letter and its combining accent, inside an
emoji sequence, before or after runs of whitespace), has exactly the tokenizer's own ids on the
whole text. Tokenizers the rules do not admit are named so, and stay exact through the checks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from prefixcache.text.prefix_tokenizer import PrefixTokenizer
from prefixcache.text.space_splits import KNOWN_SPLIT_PATTERNS, splits_at_lone_spaces
from prefixcache.text.tokenizers import HFTokenizer
from tests.text.counting_tokenizer import Counting

LLAMA3 = next(p for p in KNOWN_SPLIT_PATTERNS if r"\p{N}{1,3}" in p)  # and GPT-4's
QWEN2 = next(p for p in KNOWN_SPLIT_PATTERNS if r"|\p{N}|" in p)
GPT2 = next(p for p in KNOWN_SPLIT_PATTERNS if p.startswith("'s"))
# words and marks: ASCII, digits, punctuation and contractions, accents precomposed and combining,
# CJK, emoji with a skin tone and a joiner, the SentencePiece space mark, characters whose
# compatibility forms hold a space, and whitespace of other kinds
PIECES = [
    "the", "fleet", "routes", "Cache", "w12", "1234", "3.14", "(x)", "don't", "I'll", "--", "...",
    "é", "naïve", "e\u0301", "ü\u0308", "中文", "東京", "👍🏽", "👩\u200d💻", "\u2581a", "¨", "ﬁ",
    "\u00a0", "\u3000", "\t", "\n", "\r\n", "  ", "\x1c", "!", "'s", "Σσς",
]  # fmt: skip


def _text(rng: random.Random, pieces: int) -> str:
    out = []
    for _ in range(pieces):
        out.append(rng.choice(PIECES))
        out.append(" " if rng.random() < 0.8 else rng.choice(["", "  ", "\n", " \n "]))
    return "".join(out).strip(" ")


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [_text(rng, 120) for _ in range(40)]


def _bpe(pre: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None,
         size: int = 400) -> Tokenizer:  # fmt: skip
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if "ByteLevel" in repr(pre) else []
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<unk>", "<s>"], initial_alphabet=alphabet,
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _words() -> Tokenizer:
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(PIECES))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _llama3() -> Tokenizer:
    split = pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated")
    tok = _bpe(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)]))
    tok.add_special_tokens([AddedToken("<|eot_id|>", lstrip=True), "<|begin_of_text|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.get_vocab_size() - 1)],
    )
    return tok


def _qwen2() -> Tokenizer:
    split = pre_tokenizers.Split(Regex(QWEN2), behavior="isolated")
    seq = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)])
    return _bpe(seq, normalizers.NFC())


def _bert() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _digits_first() -> Tokenizer:
    seq = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Whitespace()]
    return _bpe(pre_tokenizers.Sequence(seq), normalizers.NFKC())


ADMITTED = {
    "words": _words,
    "gpt2": lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "gpt2-prefix-space": lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "gpt2-split": lambda: _bpe(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(GPT2), "isolated"),
                pre_tokenizers.ByteLevel(use_regex=False),
            ]
        )
    ),
    "llama3": _llama3,
    "qwen2": _qwen2,
    "metaspace-first": lambda: _bpe(pre_tokenizers.Metaspace(prepend_scheme="first")),
    "metaspace-always": lambda: _bpe(pre_tokenizers.Metaspace(prepend_scheme="always")),
    "bert": _bert,
    "digits-first": _digits_first,
}


def _legacy_sentencepiece() -> Tokenizer:
    """Llama 2's converted layout: a normalizer that prepends and replaces, no pre-tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False),
    )
    return tok


def _rstrip_token() -> Tokenizer:
    tok = _words()
    tok.add_special_tokens([AddedToken("<|end|>", rstrip=True)])
    return tok


def _unknown_pattern() -> Tokenizer:
    return _bpe(pre_tokenizers.Split(Regex(r"\S+\s?"), behavior="isolated"))


REFUSED = {
    "legacy-sentencepiece": _legacy_sentencepiece,
    "rstrip-token": _rstrip_token,
    "unknown-split-pattern": _unknown_pattern,
    "byte-level-without-regex": lambda: _bpe(pre_tokenizers.ByteLevel(use_regex=False)),
}


def _load(tok: Tokenizer, path: Path) -> HFTokenizer:
    tok.save(str(path))
    return HFTokenizer(path)


def _exact_everywhere(raw: Tokenizer, path: Path, seed: int) -> PrefixTokenizer:
    """Every text, its growths from random beginnings, and its repeats, through one
    ``PrefixTokenizer``, against ``raw`` on the whole text."""
    counted = Counting(_load(raw, path))
    cached = PrefixTokenizer(counted, segment_chars=48, window_chars=16)  # many cuts
    rng = random.Random(seed)
    for _ in range(40):
        text = _text(rng, rng.randrange(1, 90))
        for special in (False, True):
            got = cached.encode(text, add_special_tokens=special).tolist()
            assert got == raw.encode(text, add_special_tokens=special).ids, (special, text)
        for _ in range(12):  # a beginning of it seen first, then the whole text
            k = rng.randrange(1, len(text) + 1)
            begun = text[:k]
            assert cached.encode(begun).tolist() == raw.encode(begun, add_special_tokens=False).ids
            whole = cached.encode(text).tolist()
            assert whole == raw.encode(text, add_special_tokens=False).ids, (k, begun[-12:], text)
        grown = text + " " + _text(rng, rng.randrange(1, 12))
        assert cached.encode(grown).tolist() == raw.encode(grown, add_special_tokens=False).ids
        held = cached.held(grown)  # seen in full (unless the cache turned itself off)
        if cached.stats().enabled:
            assert held is not None
            assert held.tolist() == raw.encode(grown, add_special_tokens=False).ids
    return cached


@pytest.mark.parametrize("family", sorted(ADMITTED))
def test_unchecked_joins_at_lone_spaces_give_the_tokenizers_ids(
    family: str, tmp_path: Path
) -> None:
    raw = ADMITTED[family]()
    assert splits_at_lone_spaces(json.loads(raw.to_str())), family
    for seed in range(3):
        _exact_everywhere(raw, tmp_path / f"{family}.json", seed)


@pytest.mark.parametrize("family", sorted(ADMITTED))
def test_a_grown_text_tokenizes_only_its_new_words(family: str, tmp_path: Path) -> None:
    counted = Counting(_load(ADMITTED[family](), tmp_path / f"{family}.json"))
    cached = PrefixTokenizer(counted, segment_chars=48, window_chars=16)
    rng = random.Random(7)
    text = "the fleet " + _text(rng, 60) + " fleet"
    cached.encode(text)
    for _ in range(10):  # each ends with a word: the next one joins at a lone space
        more = " routes " + _text(rng, rng.randrange(1, 8)) + " w12"
        before = counted.chars
        got = cached.encode_within(text + more, max_chars=len(more))
        text += more
        assert got is not None and got.tolist() == counted.inner.encode(text).tolist()
        assert counted.chars - before == len(more)  # no text around the join tokenized
    assert cached.stats().whole == 0


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_tokenizers_outside_the_rules_keep_their_joins_checked(family: str, tmp_path: Path) -> None:
    raw = REFUSED[family]()
    assert not splits_at_lone_spaces(json.loads(raw.to_str())), family
    _exact_everywhere(raw, tmp_path / f"{family}.json", 11)


def test_encode_within_leaves_more_than_its_share_untouched(tmp_path: Path) -> None:
    counted = Counting(_load(_words(), tmp_path / "words.json"))
    cached = PrefixTokenizer(counted, segment_chars=48, window_chars=16)
    text = " ".join(["the fleet routes"] * 40)
    assert cached.encode_within(text, max_chars=len(text) - 1) is None
    assert counted.chars == 0 and cached.stats().texts == 0  # nothing tokenized, nothing kept
    assert cached.encode_within(text, max_chars=len(text)) is not None
    seen = counted.chars
    grown = text + " cache w12"
    assert cached.encode_within(grown, max_chars=len(" cache w12") - 1) is None
    got = cached.encode_within(grown, max_chars=len(" cache w12"))
    assert got is not None and got.tolist() == counted.inner.encode(grown).tolist()
    assert counted.chars - seen == len(" cache w12")
    # a tail ended inside a word ("w1" then "w12"): the join is checked, its windows counted
    inside = text + " fleet w1"
    cached.encode(inside)
    assert cached.encode_within(inside + "2", max_chars=2) is None
