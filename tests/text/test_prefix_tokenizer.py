"""PrefixTokenizer gives the ids its tokenizer gives, reusing the leading segments of texts it saw
and the tails of texts a later one continues or repeats: real Hugging Face tokenizers built here
(a word-level one, a byte-level BPE, a WordPiece), and one whose model merges across spaces,
where the cache turns itself off."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from prefixcache.text.prefix_tokenizer import DISAGREEMENTS_TO_STOP, PrefixTokenizer
from prefixcache.text.tokenizers import HFTokenizer
from tests.text.counting_tokenizer import Counting

WORDS = ["the", "fleet", "routes", "w1", "w22", "cache", "block", "é", "naïve", "1234", "(x)", "\n"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).replace(" \n ", "\n ")


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [_text(rng, 200) for _ in range(50)]


def _save(tok: Tokenizer, path: Path) -> HFTokenizer:
    tok.save(str(path))
    return HFTokenizer(path)


def _byte_bpe(path: Path) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return _save(tok, path / "bpe.json")


def _word_piece(path: Path) -> HFTokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return _save(tok, path / "wordpiece.json")


def _word_level(path: Path) -> HFTokenizer:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(WORDS) - {"\n"}))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _save(tok, path / "words.json")


@pytest.fixture(params=["bytes-bpe", "wordpiece", "words"])
def tokenizer(request: pytest.FixtureRequest, tmp_path: Path) -> HFTokenizer:
    make = {"bytes-bpe": _byte_bpe, "wordpiece": _word_piece, "words": _word_level}
    return make[request.param](tmp_path)


def test_the_ids_are_the_tokenizers_and_shared_beginnings_are_reused(
    tokenizer: HFTokenizer,
) -> None:
    cached = PrefixTokenizer(tokenizer, segment_chars=600, window_chars=100, max_tokens=10**6)
    rng = random.Random(1)
    system = _text(rng, 400)
    turns = system
    for _ in range(12):  # a conversation: each prompt extends the one before
        turns += " " + _text(rng, rng.randrange(5, 120))
        prompt = turns + " " + _text(rng, 7)
        assert np.array_equal(cached.encode(prompt), tokenizer.encode(prompt)), prompt[:80]
        other = system + " " + _text(rng, rng.randrange(1, 300))  # another user, same system
        assert np.array_equal(cached.encode(other), tokenizer.encode(other))
    stats = cached.stats()
    assert stats.enabled and stats.whole == 0
    assert stats.reused_chars > 2 * stats.tokenized_chars  # most of each prompt was reused
    short = _text(rng, 3)  # under a segment: one tail
    assert np.array_equal(cached.encode(short), tokenizer.encode(short))


def test_a_text_seen_in_full_is_not_tokenized_again(tokenizer: HFTokenizer) -> None:
    counted = Counting(tokenizer)
    cached = PrefixTokenizer(counted, segment_chars=600, window_chars=100)
    rng = random.Random(3)
    texts = [_text(rng, n) for n in (2, 40, 400, 1500)]  # within a segment, and several
    for text in texts:
        assert cached.held(text) is None  # never seen
        first = cached.encode(text)
        assert np.array_equal(first, tokenizer.encode(text))
        before = counted.chars
        again = cached.encode(text)
        held = cached.held(text)
        assert counted.chars == before  # the tokenizer was not called
        assert held is not None and np.array_equal(again, first) and np.array_equal(held, first)
    assert cached.held(texts[-1][:-1]) is None  # a part of a text seen is not held whole


def test_a_text_that_continues_another_tokenizes_only_what_follows(
    tokenizer: HFTokenizer,
) -> None:
    counted = Counting(tokenizer)
    cached = PrefixTokenizer(counted, segment_chars=600, window_chars=100)
    rng = random.Random(4)
    text = _text(rng, 300)
    cached.encode(text)
    for _ in range(10):  # an agent's prompt, grown turn by turn
        more = " " + _text(rng, rng.randrange(2, 30))
        stats = cached.stats()
        got = cached.encode(text + more)
        text += more
        assert np.array_equal(got, tokenizer.encode(text)), text[-80:]
        assert cached.stats().tokenized_chars - stats.tokenized_chars == len(more)
    assert cached.stats().whole == 0


def test_a_text_continued_many_ways_stays_reused(tokenizer: HFTokenizer) -> None:
    """Many prompts continue one text (users asking after the same document): each tokenizes
    only its own continuation, however many came before."""
    cached = PrefixTokenizer(tokenizer, segment_chars=600, window_chars=100)
    rng = random.Random(6)
    text = _text(rng, 300)
    cached.encode(text)
    for _ in range(20):
        more = " " + _text(rng, rng.randrange(2, 30))
        stats = cached.stats()
        assert np.array_equal(cached.encode(text + more), tokenizer.encode(text + more))
        assert cached.stats().tokenized_chars - stats.tokenized_chars == len(more)


def test_a_tail_that_ended_inside_a_longer_word_is_left_out(tokenizer: HFTokenizer) -> None:
    """A text cut off mid-word, then the whole word: the kept tail does not join, the text is read
    without it (the right ids), and the cache neither counts a disagreement nor turns off."""
    cached = PrefixTokenizer(tokenizer, segment_chars=600, window_chars=100)
    rng = random.Random(5)
    for _ in range(DISAGREEMENTS_TO_STOP + 2):
        text = _text(rng, 150) + " routes"
        cached.encode(text[:-3])  # "... rou"
        assert np.array_equal(cached.encode(text), tokenizer.encode(text))
    stats = cached.stats()
    assert stats.enabled and stats.whole == 0


def test_the_cache_stays_within_its_bound(tokenizer: HFTokenizer) -> None:
    cached = PrefixTokenizer(tokenizer, segment_chars=300, window_chars=50, max_tokens=400)
    rng = random.Random(2)
    for _ in range(30):
        text = _text(rng, 500)
        assert np.array_equal(cached.encode(text), tokenizer.encode(text))
        assert cached._held <= 400


def test_a_tokenizer_that_merges_across_spaces_is_tokenized_whole(tmp_path: Path) -> None:
    # a BPE over whole texts (no pre-tokenizer): its tokens span spaces
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(
        ["the fleet " * 40, "fleet the " * 40],
        trainers.BpeTrainer(vocab_size=120, show_progress=False),
    )
    plain = _save(tok, tmp_path / "spanning.json")
    cached = PrefixTokenizer(plain, segment_chars=200, window_chars=50)
    for i in range(DISAGREEMENTS_TO_STOP + 2):
        text = "the fleet " * (60 + i)
        assert np.array_equal(cached.encode(text), plain.encode(text))
    stats = cached.stats()
    assert not stats.enabled and stats.whole == DISAGREEMENTS_TO_STOP
    assert stats.reused_chars == 0
