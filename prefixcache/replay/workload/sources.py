"""Open a scenario file or a trace as a stream of requests that can be iterated again."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prefixcache.errors import ConfigError
from prefixcache.replay.run_config import ReplayConfig
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.scenario import is_scenario_path, load_scenario
from prefixcache.replay.workload.scenario_requests import Workload
from prefixcache.replay.workload.traces import (
    MOONCAKE_CONTINUATIONS,
    TraceOptions,
    detect_format,
    read_trace,
    trace_namespaces,
)


@dataclass
class Source:
    """A workload opened for replay (``open_source``, ``Source.from_requests``): what it is and
    how to make its requests. Each iteration makes them again, from the start."""

    path: str  # the file ("<memory>" for requests built in Python)
    kind: str  # scenario | mooncake | tokens | prompts | text | memory
    name: str  # the scenario's name, else the file's stem
    seed: int | None  # the seed the requests were generated or synthesized with
    multi_namespace: bool  # several namespaces may occur (isolation misses possible)
    total: int | None  # request count when known up front
    _factory: Callable[[], Iterator[Request]]

    def __iter__(self) -> Iterator[Request]:
        """The requests, from the first. A trace's bad line (TraceFormatError) or tokenizer
        (ConfigError) is raised here."""
        return self._factory()

    def sha256(self) -> str:
        """The hex SHA-256 of the file's bytes, or for requests built in Python of their tokens
        in order; OSError when the file cannot be read."""
        h = hashlib.sha256()
        if self.kind == "memory":
            for req in self:
                h.update(req.tokens.tobytes())
            return h.hexdigest()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def head(self, n: int) -> Source:
        """A copy of this source cut to its first ``n`` (>= 0) requests."""
        make = self._factory
        total = n if self.total is None else min(self.total, n)
        return replace(self, total=total, _factory=lambda: itertools.islice(make(), n))

    @classmethod
    def from_requests(cls, requests: Sequence[Request], name: str = "requests") -> Source:
        """A source of requests built in Python (tests, notebooks), kept in a list; it has no
        file or seed and is identified by its tokens' hash (``sha256``)."""
        items = list(requests)
        many = len({r.namespace for r in items}) > 1
        return cls("<memory>", "memory", name, None, many, len(items), lambda: iter(items))


def open_source(path: str | Path, config: ReplayConfig | None = None) -> Source:
    """Open a scenario file (by its suffix, see ``is_scenario_path``) or a trace as a source,
    read with ``config``'s seed and trace options (None: the defaults). A scenario is parsed
    here; a trace has its format detected from its first line (unless the config names it)
    and its token and prompt lines scanned for namespaces, and is read again at each
    iteration.

    Raises ConfigError when the file does not exist, trace options are given for a scenario,
    an option does not apply to the trace's format, or a Mooncake trace's block size is not a
    multiple of ``config.block_size``; ScenarioError (a ConfigError) for a bad scenario;
    TraceFormatError when a trace is empty, its first line names no format or a line read
    here is malformed (a scenario that is not UTF-8 too). A tokenizer or chat template that
    cannot be loaded raises ConfigError when iteration starts."""
    config = config or ReplayConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such scenario or trace file")
    if is_scenario_path(p):
        _refuse_trace_options(config, p)
        scenario = load_scenario(p)
        workload = Workload(scenario, config.seed)
        total = scenario.requests if scenario.duration_s is None else None
        if scenario.arrivals.process == "timestamps" and scenario.session is None:
            # the requests stop at the first timestamp past duration_s, or at the count
            horizon = scenario.duration_s if scenario.duration_s is not None else math.inf
            stamps = scenario.arrivals.timestamps
            within = sum(1 for _ in itertools.takewhile(lambda t: t <= horizon, stamps))
            total = within if scenario.requests is None else min(scenario.requests, within)
        return Source(
            str(p),
            "scenario",
            scenario.name,
            workload.seed,
            scenario.namespace.count > 1,
            total,
            workload.__iter__,
        )
    fmt = config.trace_format or detect_format(p, config.max_line_bytes)
    check_block_size(fmt, config.trace_block_size, config.block_size)
    _refuse_options_of_other_formats(config, p, fmt)
    seed = config.seed if config.seed is not None else 0
    options = TraceOptions(
        format=fmt,
        trace_block_size=config.trace_block_size,
        seed=seed,
        tokenizer=config.tokenizer,
        chat_template=config.chat_template,
        output_len=config.output_len,
        max_line_bytes=config.max_line_bytes,
        max_prompt_tokens=config.max_prompt_tokens,
        continuations=bool(continuations_of(fmt, config)),
    )
    return Source(
        str(p),
        fmt,
        p.stem,
        seed if fmt == "mooncake" else None,
        trace_namespaces(p, options),
        None,
        lambda: read_trace(p, options),
    )


_NO_TEXT = {  # trace formats with no text to tokenize, as named in errors
    "mooncake": "a Mooncake trace (hash ids, no text)",
    "tokens": "a token-id trace (already tokenized)",
}


def _refuse_options_of_other_formats(config: ReplayConfig, path: Path, fmt: str) -> None:
    """ConfigError for an option the trace's format has no use for (it would be ignored)."""
    if fmt in _NO_TEXT and (config.tokenizer or config.chat_template):
        raise ConfigError(
            f"{path.name} is {_NO_TEXT[fmt]}: --tokenizer and --chat-template do not apply"
        )
    if fmt == "text" and config.chat_template:
        raise ConfigError(
            f"{path.name} is a text trace (one prompt a line, no chat messages): "
            "--chat-template does not apply"
        )
    if fmt != "mooncake" and config.continuations is not None:
        raise ConfigError(
            f"--continuations links the turns of a Mooncake trace by their hash ids; {path.name} "
            f"is a {fmt} trace, whose prompts already hold their context: drop the option"
        )
    if fmt != "mooncake" and config.trace_block_size != ReplayConfig().trace_block_size:
        raise ConfigError(
            f"--trace-block-size is the block size of a Mooncake trace's hash ids; {path.name} "
            f"is a {fmt} trace: drop the option (--block-size sets the cache's)"
        )


def continuations_of(kind: str, config: ReplayConfig) -> bool | None:
    """Whether a trace of format ``kind`` is read with multi-turn continuations: the config's
    choice, else ``MOONCAKE_CONTINUATIONS``; None when ``kind`` is not Mooncake (they do not
    apply)."""
    if kind != "mooncake":
        return None
    return MOONCAKE_CONTINUATIONS if config.continuations is None else config.continuations


def check_block_size(kind: str, trace_block_size: int, block_size: int) -> None:
    """Check that a Mooncake trace's blocks (``trace_block_size`` tokens per hash id) split
    into whole cache blocks of ``block_size`` tokens; ConfigError when they do not. Other
    formats (``kind``) pass."""
    if kind == "mooncake" and trace_block_size % block_size:
        raise ConfigError(
            f"block size {block_size} does not divide the trace's {trace_block_size}"
            "-token blocks; use a divisor (e.g. 16, 64, 512) or set --trace-block-size"
        )


_TRACE_FLAGS = (  # (ReplayConfig field, its command-line flag) of the trace-only options
    ("trace_format", "--trace-format"),
    ("trace_block_size", "--trace-block-size"),
    ("tokenizer", "--tokenizer"),
    ("chat_template", "--chat-template"),
    ("output_len", "--output-len"),
    ("max_prompt_tokens", "--max-prompt-tokens"),
    ("max_line_bytes", "--max-line-bytes"),
    ("continuations", "--continuations"),
)


def _refuse_trace_options(config: ReplayConfig, path: Path) -> None:
    """ConfigError when options that only shape how a trace is read were given for a
    scenario (they would be ignored)."""
    defaults = ReplayConfig()
    given = [
        flag for attr, flag in _TRACE_FLAGS if getattr(config, attr) != getattr(defaults, attr)
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: only for traces, and {path.name} is a scenario (its file sets "
            "lengths and outputs)"
        )
