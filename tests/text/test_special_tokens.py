"""Text prompts get the special tokens the engine adds: real Hugging Face tokenizers whose
post-processor adds a BOS (Llama 3's shape: byte-level BPE with ``<|begin_of_text|> $A``;
Mistral's: a Metaspace BPE with ``<s> $A``), one that wraps both ends (BERT's ``[CLS] $A
[SEP]``) and one that adds nothing. The engine's rule, read in vLLM 0.32/0.33 and SGLang 0.5.23:
a text completion is ``tokenizer(text)`` with special tokens added (vLLM:
``CompletionRequest.add_special_tokens``, true by default), a chat is the template's text with
none added (vLLM: unless the chat request's ``add_special_tokens`` is true). The reference ids
are the ``tokenizers`` library's own ``encode`` with that flag, what transformers' fast
tokenizer calls underneath."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from prefixcache.text.prefix_tokenizer import PrefixTokenizer
from prefixcache.text.tokenizers import ByteTokenizer, HFTokenizer

WORDS = ["the", "fleet", "routes", "w1", "w22", "cache", "é", "naïve", "1234", "(x)", "\n", "  "]


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(40)]


def _llama3(path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    tok.save(str(path / "llama3.json"))
    return path / "llama3.json"


def _mistral(path: Path) -> Path:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "mistral.json"))
    return path / "mistral.json"


def _bert(path: Path) -> Path:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    vocab.update({w: i + 3 for i, w in enumerate(sorted({w.strip() for w in WORDS} - {""}))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    tok.save(str(path / "bert.json"))
    return path / "bert.json"


def _plain(path: Path) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "plain.json"))
    return path / "plain.json"


MAKERS = {"llama3": _llama3, "mistral": _mistral, "bert": _bert, "none": _plain}
ADDED = {"llama3": (1, 0), "mistral": (1, 0), "bert": (1, 1), "none": (0, 0)}


def _texts(rng: random.Random) -> list[str]:
    """Texts as prompts come, and ones that try the edges: empty, blank, leading and trailing
    spaces, a special token's text inside the prompt, long ones sharing their beginning."""
    long = " ".join(rng.choice(WORDS) for _ in range(900))
    out = ["", " ", "\n", "the", "  the fleet ", "<s> w1 </s>", "<|begin_of_text|>the", "[CLS] w1"]
    out += [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60))) for _ in range(20)]
    out += [long + " " + " ".join(rng.choice(WORDS) for _ in range(k)) for k in range(1, 12)]
    out += [long[: rng.randrange(len(long))] for _ in range(10)]
    return out


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_text_prompts_get_the_special_tokens_the_engine_adds(kind: str, tmp_path: Path) -> None:
    path = MAKERS[kind](tmp_path)
    engine = Tokenizer.from_file(str(path))  # what vLLM and SGLang tokenize with
    plain = HFTokenizer(path)
    head, tail = ADDED[kind]
    wrap = plain.special_wrap
    assert wrap is not None and (len(wrap.head), len(wrap.tail)) == (head, tail)
    cached = PrefixTokenizer(plain, segment_chars=600, window_chars=100)
    for text in _texts(random.Random(kind)):
        for add in (True, False):  # a completion (vLLM's default, SGLang's always); a chat
            want = engine.encode(text, add_special_tokens=add).ids
            assert plain.encode(text, add_special_tokens=add).tolist() == want, (kind, text)
            got = cached.encode(text, add_special_tokens=add)
            assert got.dtype == np.dtype("<i4") and got.tolist() == want, (kind, add, text[:60])
            held = cached.held(text, add_special_tokens=add)  # seen in full: no tokenizer
            assert held is not None and held.tolist() == want, (kind, add, text[:60])
    assert cached.stats().reused_chars > 0  # the long texts' beginnings came from the cache
    assert plain.encode("the").tolist() == engine.encode("the", add_special_tokens=False).ids


def test_the_bytes_tokenizer_has_no_special_tokens() -> None:
    tok = ByteTokenizer()
    assert tok.encode("ab", add_special_tokens=True).tolist() == [97, 98]


def test_a_post_processor_that_is_not_one_wrap_is_run_on_each_text(tmp_path: Path) -> None:
    """A template whose special tokens do not sit at the ends of every text the same way (here:
    ``$A`` twice) is no fixed wrap: each text goes through the tokenizer with its special
    tokens, whole, and the ids are still the engine's."""
    path = _plain(tmp_path)
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A <s> $A", pair="$A $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(tmp_path / "twice.json"))
    plain = HFTokenizer(tmp_path / "twice.json")
    assert plain.special_wrap is None
    cached = PrefixTokenizer(plain, segment_chars=200, window_chars=50)
    text = " ".join(f"w{i % 50}" for i in range(400))
    for t in (text, text + " w3", "w1"):
        assert cached.encode(t, add_special_tokens=True).tolist() == tok.encode(t).ids
        assert cached.encode(t).tolist() == tok.encode(t, add_special_tokens=False).ids
