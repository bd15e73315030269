"""Trace readers: one JSON object (or text prompt) per line, streamed, never loaded whole.

- Mooncake: ``{timestamp (ms), input_length, output_length, hash_ids}``, one hash id per trace
  block (512 tokens by default). Tokens are synthesized per hash id, so equal ids give equal
  blocks; a partial last block is the head of its id's block.
- tokens: ``{token_ids | input_ids | tokens: [...]}``.
- prompts: ``{prompt | text: "..."}`` or ``{messages: [{role, content}, ...]}`` through a
  tokenizer (messages through the model's chat template when one is given, else a neutral
  rendering); ``.txt`` files hold one prompt per line.

Optional on the token and prompt formats: ``arrival_s`` (or ``timestamp`` in seconds),
``output_length``, ``n``; on those and on Mooncake lines, namespace fields ``model``,
``adapter``, ``adapter_version``, ``salt`` (the tenant; ``tenant`` is taken for it too). A bad
line raises TraceFormatError with its line number.

Two guards stop a malformed or hostile line before it costs memory: a line longer than
``max_line_bytes`` is rejected while it is read (never held whole), and a prompt longer than
``max_prompt_tokens`` (for Mooncake, its ``input_length``) before its tokens are built.

Mooncake traces give only a hash id per trace block: each id's block is synthesized once
(counter-based, so it depends only on the id and the seed) and kept in a bounded cache; a request's
tokens are the concatenation of its blocks, the last one cut to the input length. Text prompts go
through a dependency-free byte-level tokenizer, or a Hugging Face ``tokenizers`` JSON file (needs
the ``tokenizers`` package, imported only then).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.blocks.namespace import DEFAULT_NAMESPACE, Namespace
from prefixcache.blocks.tokens import as_token_array
from prefixcache.errors import ConfigError, InvalidArgumentError, InvalidTokensError
from prefixcache.replay.workload.arrivals import MAX_TIME_S
from prefixcache.replay.workload.continuations import Continuations, plan_continuations
from prefixcache.replay.workload.input_errors import TraceFormatError
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.synth import FULL_VOCAB, blocks_tokens, mix64, stream_key
from prefixcache.replay.workload.text_input import not_utf8_error
from prefixcache.text.tokenizers import Tokenizer, load_tokenizer, render_chat

FORMATS = ("mooncake", "tokens", "prompts", "text")
TOKEN_KEYS = ("token_ids", "input_ids", "tokens")  # a token-id record's list, the first found
PROMPT_KEYS = ("prompt", "text", "messages")  # what makes a record a prompt record
NAMESPACE_KEYS = ("model", "adapter", "adapter_version", "salt")  # a record's namespace fields
TENANT_KEY = "tenant"  # another name for ``salt``: the cache salt is the tenant
MAX_LINE_BYTES = 16 << 20  # a 2M-token prompt as token ids fits
MAX_PROMPT_TOKENS = 2 << 20
MOONCAKE_CONTINUATIONS = False  # the default of --continuations (see BENCHMARKS.md)


@dataclass(frozen=True)
class TraceOptions:
    """How ``read_trace`` reads a trace; each field says which formats it applies to."""

    format: str | None = None  # None: detect from the first line
    trace_block_size: int = 512  # Mooncake: tokens per hash id
    seed: int = 0  # Mooncake: token synthesis
    vocab_size: int | None = None  # Mooncake: None = the whole int31 range
    tokenizer: str | None = None  # prompts/text: tokenizer.json path, None = bytes
    chat_template: str | None = None  # prompts with messages: the model's template, None = neutral
    output_len: int = 128  # when a line gives none
    namespace: Namespace = DEFAULT_NAMESPACE
    max_line_bytes: int = MAX_LINE_BYTES  # longest line read
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # longest prompt built
    continuations: bool = False  # Mooncake: later turns hit the blocks earlier turns decoded


def detect_format(path: str | Path, limit: int = MAX_LINE_BYTES) -> str:
    """The format of a trace (one of ``FORMATS``): ``text`` for a ``.txt`` file, else from its
    first non-empty line. Raises TraceFormatError when the trace is empty or that line is
    longer than ``limit`` bytes, not UTF-8, not a JSON object or no known record; OSError when
    the file cannot be read."""
    p = Path(path)
    if p.suffix.lower() == ".txt":
        return "text"
    for lineno, line in _lines(str(p), limit):
        obj = _parse(line, str(p), lineno)
        if "hash_ids" in obj:
            return "mooncake"
        if any(k in obj for k in TOKEN_KEYS):
            return "tokens"
        if any(k in obj for k in PROMPT_KEYS):
            return "prompts"
        raise TraceFormatError(
            str(p),
            lineno,
            "unrecognized record: expected hash_ids (Mooncake), one of "
            f"{', '.join(TOKEN_KEYS)} (token ids) or {', '.join(PROMPT_KEYS)} (text)",
        )
    raise TraceFormatError(str(p), 0, "the trace is empty")


def read_trace(path: str | Path, options: TraceOptions | None = None) -> Iterator[Request]:
    """The requests of a trace, read lazily line by line with ``options`` (None: the
    defaults); a bad line raises TraceFormatError with its number while iterating. Raised
    now: the errors of ``detect_format`` when ``options.format`` is None, and ConfigError for
    an unknown format or a tokenizer or chat template that cannot be loaded."""
    options = options or TraceOptions()
    fmt = options.format or detect_format(path, options.max_line_bytes)
    if fmt == "mooncake":
        return _mooncake(str(path), options)
    if fmt == "tokens":
        return _tokens(str(path), options)
    if fmt in ("prompts", "text"):
        tokenizer = load_tokenizer(options.tokenizer)
        return _prompts(str(path), options, tokenizer, _chat_renderer(options), text=fmt == "text")
    raise ConfigError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")


def trace_namespaces(path: str | Path, options: TraceOptions) -> bool:
    """Whether the trace's records name more than one namespace (model, adapter, version,
    salt). One pass over the lines, stopping at the second namespace; only a line that mentions
    a namespace key is parsed. Text traces have none: False without reading.
    Raises TraceFormatError for a line that is too long, not UTF-8, or (when parsed) not a
    JSON object."""
    fmt = options.format or detect_format(path, options.max_line_bytes)
    if fmt == "text":
        return False
    needles = [f'"{k}"' for k in (*NAMESPACE_KEYS, TENANT_KEY)]
    default = (repr(None),) * len(NAMESPACE_KEYS)
    seen: set[tuple[str, ...]] = set()
    for lineno, line in _lines(str(path), options.max_line_bytes):
        key = default
        if any(n in line for n in needles):
            record = _parse(line, str(path), lineno)
            if TENANT_KEY in record and "salt" not in record:
                record["salt"] = record[TENANT_KEY]
            key = tuple(repr(record.get(k)) for k in NAMESPACE_KEYS)  # any JSON value
        seen.add(key)
        if len(seen) > 1:
            return True
    return False


def _lines(path: str, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """Non-empty lines with their numbers; a line over ``limit`` bytes is an error."""
    with open(path, "rb") as f:
        lineno = 0
        while raw := f.readline(limit + 1):
            lineno += 1
            if len(raw) > limit and not (len(raw) == limit + 1 and raw.endswith(b"\n")):
                raise TraceFormatError(
                    path,
                    lineno,
                    f"line longer than {limit:,} bytes (raise the limit with --max-line-bytes)",
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8_error(path, lineno, exc) from None
            if line.strip():
                yield lineno, line


def _check_prompt(tokens: int, opt: TraceOptions, path: str, lineno: int) -> None:
    """TraceFormatError when a prompt of ``tokens`` tokens passes ``opt.max_prompt_tokens``."""
    if tokens > opt.max_prompt_tokens:
        raise TraceFormatError(
            path,
            lineno,
            f"prompt of {tokens:,} tokens, over the limit of {opt.max_prompt_tokens:,} "
            "(raise it with --max-prompt-tokens)",
        )


def _parse(line: str, path: str, lineno: int) -> dict[str, Any]:
    """The JSON object of a line; TraceFormatError when it is not one."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, lineno, f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, lineno, "expected a JSON object")
    return obj


def _int(
    obj: dict[str, Any], key: str, path: str, lineno: int, minimum: int, default: int | None = None
) -> int:
    """Integer field ``key`` (>= ``minimum``; ``default`` when absent, None: required);
    TraceFormatError otherwise."""
    value = obj.get(key, default)
    if value is None:
        raise TraceFormatError(path, lineno, f"missing field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(
            path, lineno, f"'{key}' must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _time(
    obj: dict[str, Any], keys: tuple[str, ...], scale: float, path: str, lineno: int, default: float
) -> float:
    """The first of ``keys`` present, times ``scale``, in seconds (``default`` when none is);
    TraceFormatError unless it is a number in ``[0, MAX_TIME_S]``."""
    for key in keys:
        if key in obj:
            value = obj[key]
            try:
                seconds = value * scale if isinstance(value, (int, float)) else math.nan
            except OverflowError:  # an integer of hundreds of digits
                seconds = math.inf
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= seconds <= MAX_TIME_S  # NaN and infinity fail here too
            ):
                raise TraceFormatError(
                    path,
                    lineno,
                    f"'{key}' must be a finite number >= 0 (at most {MAX_TIME_S:g} s), "
                    f"got {value!r}",
                )
            return float(seconds)
    return default


def _mooncake(path: str, opt: TraceOptions) -> Iterator[Request]:
    """The requests of a Mooncake trace (planning its continuations first when asked)."""
    block = opt.trace_block_size
    synth = MooncakeTokens(block, opt.seed, opt.vocab_size)
    cache: dict[tuple, Namespace] = {}
    turns = None
    if opt.continuations:
        plan = plan_continuations(_lines(path, opt.max_line_bytes), block)
        turns = Continuations(plan, opt.seed, synth.vocab) if plan else None
    for index, (lineno, line) in enumerate(_lines(path, opt.max_line_bytes)):
        obj = _parse(line, path, lineno)
        length = _int(obj, "input_length", path, lineno, 1)
        _check_prompt(length, opt, path, lineno)
        output = _int(obj, "output_length", path, lineno, 0, default=opt.output_len)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list):
            raise TraceFormatError(path, lineno, "'hash_ids' must be a list of integers")
        if len(ids) != -(-length // block):
            raise TraceFormatError(
                path,
                lineno,
                f"{len(ids)} hash_ids for input_length {length}: expected "
                f"ceil({length} / {block}) = {-(-length // block)} (one per {block}-token block)",
            )
        try:
            context = turns.parent_context(index) if turns is not None else None
            if context is not None:
                synth.fix(ids, *context)
            tokens = synth.tokens(ids, length)
        except (TypeError, ValueError, OverflowError):
            raise TraceFormatError(path, lineno, "'hash_ids' must be integers >= 0") from None
        arrival = _time(obj, ("timestamp",), 1e-3, path, lineno, 0.0)
        out = turns.output_of(index, tokens, output, block) if turns is not None else None
        ns = _namespace(obj, opt.namespace, path, lineno)
        ns = cache.setdefault((ns.model, ns.adapter, ns.adapter_version, ns.salt), ns)
        yield Request(arrival, tokens, output, ns, 1, out)


def _namespace(obj: dict[str, Any], base: Namespace, path: str, lineno: int) -> Namespace:
    """A record's namespace: its namespace fields over ``base``'s; TraceFormatError for a
    field that is not a string or null."""
    if TENANT_KEY in obj:
        if "salt" in obj and obj["salt"] != obj[TENANT_KEY]:
            raise TraceFormatError(path, lineno, "'tenant' and 'salt' differ: give one of them")
        obj = {**obj, "salt": obj[TENANT_KEY]}
    if not any(k in obj for k in NAMESPACE_KEYS):
        return base
    fields = {}
    for key in NAMESPACE_KEYS:
        value = obj.get(key, getattr(base, key))
        if value is not None and not isinstance(value, str):
            raise TraceFormatError(path, lineno, f"'{key}' must be a string, got {value!r}")
        fields[key] = value
    return Namespace(
        model=fields["model"] or "",
        adapter=fields["adapter"],
        adapter_version=fields["adapter_version"],
        salt=fields["salt"],
    )


def _tokens(path: str, opt: TraceOptions) -> Iterator[Request]:
    """The requests of a token-id trace."""
    cache: dict[tuple, Namespace] = {}
    for lineno, line in _lines(path, opt.max_line_bytes):
        obj = _parse(line, path, lineno)
        ids = next((obj[k] for k in TOKEN_KEYS if k in obj), None)
        if not isinstance(ids, list) or not ids:
            raise TraceFormatError(
                path, lineno, f"expected a non-empty list in one of {', '.join(TOKEN_KEYS)}"
            )
        _check_prompt(len(ids), opt, path, lineno)
        try:  # integers only: no float, numeric string or boolean is taken for a token
            arr = as_token_array(ids)
        except InvalidTokensError as exc:
            raise TraceFormatError(path, lineno, str(exc)) from None
        yield _request(obj, arr, opt, path, lineno, cache)


def _chat_renderer(options: TraceOptions) -> Callable[[list[dict[str, Any]]], str]:
    """How conversations become prompt text: the model's chat template (as an engine renders
    it, generation prompt included) or the neutral rendering."""
    if options.chat_template is None:
        return render_chat
    from prefixcache.text.chat_template import ChatTemplate, chat_messages

    template = ChatTemplate.load(options.chat_template)
    return lambda messages: template.render(chat_messages(messages, template.content_format))


def _prompts(
    path: str,
    opt: TraceOptions,
    tok: Tokenizer,
    render: Callable[[list[dict[str, Any]]], str],
    *,
    text: bool,
) -> Iterator[Request]:
    """The requests of a prompt trace (JSON records) or, with ``text``, a text file (a prompt
    per line, every request with ``opt``'s output length and namespace, at time 0)."""
    cache: dict[tuple, Namespace] = {}
    if text:
        for lineno, line in _lines(path, opt.max_line_bytes):
            tokens = tok.encode(line.rstrip("\r\n"))
            if len(tokens) == 0:
                raise TraceFormatError(path, lineno, "the prompt encodes to no tokens")
            _check_prompt(len(tokens), opt, path, lineno)
            yield Request(0.0, tokens, opt.output_len, opt.namespace)
        return
    for lineno, line in _lines(path, opt.max_line_bytes):
        obj = _parse(line, path, lineno)
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in msgs
            ):
                raise TraceFormatError(
                    path, lineno, "'messages' must be a list of {role: str, content: str}"
                )
            try:
                prompt = render(msgs)
            except InvalidArgumentError as exc:  # the template refused the conversation
                raise TraceFormatError(path, lineno, str(exc)) from None
        else:
            given = obj.get("prompt", obj.get("text"))
            if not isinstance(given, str):
                raise TraceFormatError(
                    path, lineno, "expected a string in 'prompt' or 'text', or 'messages'"
                )
            prompt = given
        tokens = tok.encode(prompt)
        if len(tokens) == 0:
            raise TraceFormatError(path, lineno, "the prompt encodes to no tokens")
        _check_prompt(len(tokens), opt, path, lineno)
        yield _request(obj, tokens, opt, path, lineno, cache)


def _request(
    obj: dict[str, Any],
    tokens: np.ndarray,
    opt: TraceOptions,
    path: str,
    lineno: int,
    cache: dict[tuple, Namespace],
) -> Request:
    """The request of a token or prompt record; equal namespaces share one object (``cache``)."""
    arrival = _time(obj, ("arrival_s", "timestamp"), 1.0, path, lineno, 0.0)
    output = _int(obj, "output_length", path, lineno, 0, default=opt.output_len)
    n = _int(obj, "n", path, lineno, 1, default=1)
    ns = _namespace(obj, opt.namespace, path, lineno)
    ns = cache.setdefault((ns.model, ns.adapter, ns.adapter_version, ns.salt), ns)
    return Request(arrival, tokens, output, ns, n)


# ---- Mooncake token synthesis -----------------------------------------------------------------


class MooncakeTokens:
    """Token ids of Mooncake requests, from one synthesized block of ``block_size`` tokens per
    hash id, the same for the same ``seed`` and ``vocab_size`` (None: ``FULL_VOCAB``). At most
    about ``max_cached_blocks`` blocks are kept; past that the cache is emptied and blocks are
    synthesized again (identically), except the ones ``fix`` rebuilt."""

    def __init__(
        self,
        block_size: int = 512,
        seed: int = 0,
        vocab_size: int | None = None,
        max_cached_blocks: int = 1 << 16,
    ) -> None:
        self.block_size = block_size
        self.vocab = vocab_size or FULL_VOCAB
        self._salt = np.uint64(stream_key("mooncake", seed))
        self._cache: dict[int, np.ndarray] = {}
        self._fixed: dict[int, np.ndarray] = {}  # blocks a continuation rebuilt, kept for good
        self._limit = max_cached_blocks

    def tokens(self, hash_ids: list[int], length: int) -> np.ndarray:
        """The ``length`` int32 tokens of a request with these hash ids: their blocks in
        order, the last one cut. With one id the result is a view of the cached block: read,
        never write, it. Raises ValueError for a new id that is not an int >= 0, OverflowError
        for one of 2**64 or more, TypeError for one that cannot be hashed."""
        if not all(type(h) is int for h in hash_ids):  # 1.0 or True equal a cached 1
            raise ValueError("hash ids must be integers >= 0")
        cache = self._cache
        missing = [h for h in hash_ids if h not in cache]
        if missing:
            if not all(h >= 0 for h in missing):
                raise ValueError("hash ids must be integers >= 0")
            if len(cache) + len(missing) > self._limit:
                cache.clear()  # a crude bound: blocks are regenerated identically when needed
                cache.update(self._fixed)
                missing = [h for h in dict.fromkeys(hash_ids) if h not in cache]
            ids = np.asarray(missing, dtype=np.uint64)
            rows = blocks_tokens(mix64(ids ^ self._salt), self.block_size, self.vocab)
            for h, row in zip(missing, rows, strict=True):
                cache[h] = row
        if len(hash_ids) == 1:
            return cache[hash_ids[0]][:length]
        return np.concatenate([cache[h] for h in hash_ids])[:length]

    def fix(self, hash_ids: list[int], start: int, context: np.ndarray) -> None:
        """Rebuild the blocks of ``hash_ids`` that cover positions ``start ..
        start + len(context)`` with ``context`` there (a continued turn's prompt tail and
        output), the rest synthesized; each id keeps its first rebuilt block for good, so an
        id rebuilt before is left as it is. Raises as ``tokens`` does for a bad id."""
        p, end = self.block_size, start + len(context)
        for b in range(start // p, min(len(hash_ids), -(-end // p))):
            h = hash_ids[b]
            if h in self._fixed:
                continue
            row = self.tokens([h], p).copy()
            lo, hi = max(start, b * p), min(end, (b + 1) * p)
            row[lo - b * p : hi - b * p] = context[lo - start : hi - start]
            self._fixed[h] = self._cache[h] = row
