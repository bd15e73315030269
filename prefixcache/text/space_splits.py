"""Whether a tokenizer's tokens never span a lone space, read from its ``tokenizer.json``.

A lone space is a space between two characters that are not whitespace. When every part of a
tokenizer keeps to it, a text cut just before a lone space tokenizes as its two parts do, joined,
so ``PrefixTokenizer`` joins token ids there without tokenizing the text around the join to check
it. The parts, as ``tokenizers`` runs them on a text:

- **Added tokens** are matched in the raw text first. None may hold whitespace, or take the
  whitespace after it (``rstrip``); taking the whitespace before it (``lstrip``) happens the same
  way in the whole text and in the part that begins with the space.
- **The normalizer** maps characters one by one, never across a space: none, ``NFC``, ``NFD``,
  ``NFKC``, ``NFKD``, ``Lowercase``, ``StripAccents``, ``BertNormalizer`` or a ``Sequence`` of
  them (not ``Prepend``, ``Strip``, ``Replace`` or a compiled SentencePiece map).
- **The pre-tokenizer** puts a boundary at every lone space, and what it does on either side
  depends on that side alone: its first stage that splits at spaces (``WhitespaceSplit``,
  ``Whitespace``, ``BertPreTokenizer``, ``ByteLevel`` with its regex, ``Metaspace`` splitting on
  its replacement character, or ``Split`` on one of the known patterns below, isolated) comes
  before any stage that rewrites characters, and only ``Digits`` and ``Punctuation`` (which split
  further, never join) may come before it; ``Metaspace``, whose ``first`` prepend scheme depends on
  where a piece begins, only as the first stage. In each known pattern a match holds whitespace
  only at its start or in a run of whitespace, so no match crosses a lone space, and at the
  space the pattern acts as at the end of the text (its one lookahead, ``(?!\\S)``, agrees).
- **The model** works on each pre-token alone: ``BPE`` (without dropout), ``WordPiece``,
  ``WordLevel``, ``Unigram``.
- **The post-processor** leaves a text's ids as they are when no special tokens are asked for:
  none, ``ByteLevel``, ``BertProcessing``, ``RobertaProcessing``, a ``TemplateProcessing`` whose
  one-text template holds the text once, or a ``Sequence`` of them (a template that repeats the
  text repeats it without special tokens too).
- No ``truncation`` or ``padding`` in the file (both would act on the whole text only).

Anything else (a pre-tokenizer missing, a pattern not known here, a normalizer that prepends) is
answered False, and the joins stay checked.
"""

from __future__ import annotations

from typing import Any

# split patterns whose matches never cross a lone space (GPT-2's; Llama 3's and GPT-4's; Qwen2's)
KNOWN_SPLIT_PATTERNS = frozenset(
    (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )
)
_CHARWISE_NORMALIZERS = frozenset(
    ("NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "BertNormalizer")
)
_PER_PRETOKEN_MODELS = frozenset(("BPE", "WordPiece", "WordLevel", "Unigram"))
_SPACE_SPLITTERS = frozenset(("WhitespaceSplit", "Whitespace", "BertPreTokenizer"))
_SPLIT_ONLY = frozenset(("Digits", "Punctuation"))  # split further, rewrite nothing
_IDS_KEPT_PROCESSORS = frozenset(("ByteLevel", "BertProcessing", "RobertaProcessing"))


def splits_at_lone_spaces(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer described by ``spec`` (a ``tokenizer.json``, parsed) tokenizes a
    text cut before a lone space as its two parts, joined (the rules above)."""
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return False
    for token in spec.get("added_tokens") or ():
        content = token.get("content", "")
        if token.get("rstrip") or any(c.isspace() for c in content):
            return False
    model = spec.get("model") or {}
    if model.get("type") not in _PER_PRETOKEN_MODELS or model.get("dropout") not in (None, 0, 0.0):
        return False
    return (
        _charwise(spec.get("normalizer"))
        and _splits_first(spec.get("pre_tokenizer"))
        and _keeps_ids(spec.get("post_processor"))
    )


def _charwise(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_charwise(n) for n in normalizer.get("normalizers") or ())
    return kind in _CHARWISE_NORMALIZERS


def _keeps_ids(processor: dict[str, Any] | None) -> bool:
    """Whether the post-processor leaves the ids of one text alone without special tokens."""
    if processor is None:
        return True
    kind = processor.get("type")
    if kind == "Sequence":
        return all(_keeps_ids(p) for p in processor.get("processors") or ())
    if kind == "TemplateProcessing":
        return sum("Sequence" in piece for piece in processor.get("single") or ()) == 1
    return kind in _IDS_KEPT_PROCESSORS


def _splits_first(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer's stages put a boundary at every lone space before anything
    rewrites a character, and keep to the stages named above."""
    if pre_tokenizer is None:
        return False
    stages = (
        list(pre_tokenizer.get("pretokenizers") or ())
        if pre_tokenizer.get("type") == "Sequence"
        else [pre_tokenizer]
    )
    split = False  # a boundary at every lone space already
    for i, stage in enumerate(stages):
        kind = stage.get("type")
        if kind == "Metaspace" and i > 0:
            return False
        if _splits_at_spaces(stage):
            split = True
        elif kind in _SPLIT_ONLY or (kind == "ByteLevel" and split):
            continue
        else:
            return False
    return split


def _splits_at_spaces(stage: dict[str, Any]) -> bool:
    kind = stage.get("type")
    if kind in _SPACE_SPLITTERS:
        return True
    if kind == "ByteLevel":
        return bool(stage.get("use_regex", True))
    if kind == "Metaspace":
        return bool(stage.get("split", True)) and stage.get("replacement", "\u2581") != " "
    if kind == "Split":
        pattern = stage.get("pattern") or {}
        return (
            pattern.get("Regex") in KNOWN_SPLIT_PATTERNS
            and stage.get("behavior") == "Isolated"
            and not stage.get("invert", False)
        )
    return False
