"""Declarative workload files (YAML or TOML): parsed and validated into a ``Scenario``.

A prompt is a list of segments, each a one-key mapping:

- ``shared``: the same tokens for every request; ``variants`` > 1 gives several alternatives
  (system prompts, few-shot templates) picked by ``weights``.
- ``pool``: ``pick`` items from a pool of ``size`` items (RAG documents, few-shot examples) by
  ``popularity``, in ``order: random`` (varying positions) or ``sorted``.
- ``unique``: fresh tokens per request (the user's question).

``session`` turns single requests into multi-turn chats or agent loops: each later turn's prompt
is the previous prompt, the previous output (``keep_output``) and the ``turn`` segments.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.replay.workload.arrivals import MAX_TIME_S
from prefixcache.replay.workload.input_errors import ScenarioError
from prefixcache.replay.workload.scenario_values import (
    Dist,
    Where,
    boolean,
    get,
    integer,
    mapping,
    number,
    parse_dist,
    parse_weights,
    sequence,
    string,
)
from prefixcache.replay.workload.synth import FULL_VOCAB
from prefixcache.replay.workload.text_input import read_utf8

SCENARIO_SUFFIXES = (".yaml", ".yml", ".toml")  # a file with one of these is a scenario
_TOP = (  # the top-level fields a scenario may have
    "name",
    "description",
    "seed",
    "requests",
    "duration_s",
    "vocab_size",
    "arrivals",
    "namespace",
    "prompt",
    "output",
    "n",
    "session",
)
PROCESSES = ("poisson", "constant", "gamma")  # the arrival processes besides timestamps


@dataclass(frozen=True)
class Segment:
    """One part of a prompt (see the module docstring). ``name`` keys its token streams and
    random draws; ``length`` is in tokens, drawn once per variant or pool item for ``shared``
    and ``pool``, once per request for ``unique``."""

    kind: str  # shared | pool | unique
    name: str
    length: Dist
    variants: int = 1  # shared
    size: int = 0  # pool
    pick: Dist | None = None  # pool: distinct items per request (None for other kinds)
    order: str = "random"  # pool
    weights: tuple[float, ...] = ()  # shared variants / pool popularity (probabilities)


@dataclass(frozen=True)
class Arrivals:
    """When sessions (or single requests) start: a process at ``rate`` per second, or the
    given ``timestamps``."""

    process: str  # poisson | constant | gamma | timestamps
    rate: float = 0.0  # sessions (or requests) per second
    cv: float = 1.0  # gamma: coefficient of variation of the gaps
    timestamps: tuple[float, ...] = ()  # process "timestamps": the times, non-decreasing seconds


@dataclass(frozen=True)
class NamespaceMix:
    """The namespaces requests are spread over: every tenant (a cache salt; None: none) with
    every adapter (None: the base model), each picked by its weight (probabilities)."""

    model: str = ""
    tenants: tuple[str | None, ...] = (None,)
    tenant_weights: tuple[float, ...] = (1.0,)
    adapters: tuple[str | None, ...] = (None,)
    adapter_weights: tuple[float, ...] = (1.0,)
    adapter_version: str | None = None  # of every adapter; None: unversioned

    @property
    def count(self) -> int:
        """How many namespaces: tenants times adapters."""
        return len(self.tenants) * len(self.adapters)


@dataclass(frozen=True)
class Session:
    """Multi-turn sessions: each later turn's prompt is the previous prompt, its output when
    ``keep_output``, then the ``turn`` segments."""

    turns: Dist  # turns per session (at least 1)
    think_time_s: Dist  # seconds from one turn's arrival to the next's
    keep_output: bool
    turn: tuple[Segment, ...]
    max_context: int | None  # tokens; a session ends before a turn that would pass it


@dataclass(frozen=True)
class Scenario:
    """A validated scenario file (``load_scenario``); ``Workload`` turns it into requests."""

    path: str
    name: str  # the file's stem unless it names itself
    description: str
    seed: int
    requests: int | None  # at most this many requests; None: bounded by time or timestamps
    duration_s: float | None  # no request arrives after this many seconds; None: no horizon
    vocab_size: int  # token ids are below it
    arrivals: Arrivals
    namespace: NamespaceMix
    prompt: tuple[Segment, ...]
    output: Dist  # output tokens per request
    n: int  # parallel samples per request
    session: Session | None  # None: single requests


def is_scenario_path(path: str | Path) -> bool:
    """Whether ``path`` names a scenario file, by its suffix (``SCENARIO_SUFFIXES``, any case);
    the file is not opened."""
    return Path(path).suffix.lower() in SCENARIO_SUFFIXES


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (YAML, or TOML by its ``.toml`` suffix). A file that
    cannot be read, does not parse or has a bad field raises ScenarioError naming the field;
    bytes that are not UTF-8 raise TraceFormatError naming the line."""
    p = Path(path)
    try:
        text = read_utf8(p)
    except OSError as exc:
        raise ScenarioError(str(p), "", "a readable file", exc.strerror) from None
    return parse_scenario(_load_document(text, str(p)), str(p), default_name=p.stem)


def parse_scenario(doc: Any, file: str, default_name: str = "scenario") -> Scenario:
    """Validate a parsed scenario document (the mapping YAML or TOML gives) into a
    ``Scenario``; ``file`` names it in errors, ``default_name`` is the name when it gives none.
    Raises ScenarioError for an unknown or missing field or a value of the wrong type or
    range."""
    top = Where(file)
    m = mapping(doc, top, _TOP)
    requests = get(m, "requests", top, None)
    duration = get(m, "duration_s", top, None)
    arrivals = _arrivals(get(m, "arrivals", top), top / "arrivals")
    if requests is None and duration is None and arrivals.process != "timestamps":
        raise (top / "requests").fail("a request count (or duration_s) to bound the workload")
    vocab = integer(get(m, "vocab_size", top, FULL_VOCAB), top / "vocab_size", minimum=2)
    if vocab > FULL_VOCAB:
        raise (top / "vocab_size").fail(f"an integer <= {FULL_VOCAB}", vocab)
    prompt_where = top / "prompt"
    prompt = tuple(
        _segment(s, prompt_where / i, i)
        for i, s in enumerate(sequence(get(m, "prompt", top), prompt_where, min_len=1))
    )
    session = get(m, "session", top, None)
    return Scenario(
        path=file,
        name=string(get(m, "name", top, default_name), top / "name"),
        description=string(get(m, "description", top, ""), top / "description"),
        seed=integer(get(m, "seed", top), top / "seed", minimum=0),
        requests=None if requests is None else integer(requests, top / "requests", minimum=1),
        duration_s=None if duration is None else number(duration, top / "duration_s", 0, True),
        vocab_size=vocab,
        arrivals=arrivals,
        namespace=_namespace(get(m, "namespace", top, {}), top / "namespace"),
        prompt=prompt,
        output=parse_dist(get(m, "output", top), top / "output", integer_valued=True, minimum=0),
        n=integer(get(m, "n", top, 1), top / "n", minimum=1),
        session=None if session is None else _session(session, top / "session"),
    )


def _load_document(text: str, file: str) -> Any:
    """``text`` parsed as TOML or YAML (by ``file``'s suffix); ScenarioError when it does not."""
    if file.lower().endswith(".toml"):
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ScenarioError(
                    file, "", "Python 3.11+ or the tomli package for TOML"
                ) from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(file, "", f"valid TOML ({exc})") from None
    import yaml

    class _UniqueKeys(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (the last one would win
        silently)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may repeat keys
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, str):  # the base loader refuses the unhashable ones
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ScenarioError(file, "", f"valid YAML ({problem}{at})") from None


def _arrivals(value: Any, where: Where) -> Arrivals:
    """The ``arrivals`` mapping, checked."""
    m = mapping(value, where, ("process", "rate", "cv", "timestamps"))
    if "timestamps" in m:
        for other in ("process", "rate", "cv"):
            if other in m:  # the timestamps decide every arrival: this would be ignored
                raise (where / other).fail("nothing next to timestamps", m[other])
        stamps = sequence(m["timestamps"], where / "timestamps", min_len=1)
        times = [number(t, where / "timestamps" / i, minimum=0) for i, t in enumerate(stamps)]
        for i, t in enumerate(times):
            if t > MAX_TIME_S:
                raise (where / "timestamps" / i).fail(f"a time of at most {MAX_TIME_S:g} s", t)
        if any(b < a for a, b in itertools.pairwise(times)):
            raise (where / "timestamps").fail("non-decreasing times in seconds")
        return Arrivals("timestamps", timestamps=tuple(times))
    process = string(get(m, "process", where), where / "process", PROCESSES)
    rate = number(get(m, "rate", where), where / "rate", minimum=0, strict=True)
    if "cv" in m and process != "gamma":
        raise (where / "cv").fail("no cv: only the gamma process has one", m["cv"])
    cv = number(get(m, "cv", where, 1.0), where / "cv", minimum=0, strict=True)
    return Arrivals(process, rate, cv)


def _segment(value: Any, where: Where, index: int, prefix: str = "") -> Segment:
    """One prompt or turn segment, checked; unnamed, it is named ``{prefix}{kind}{index}``."""
    if not isinstance(value, dict) or len(value) != 1:
        raise where.fail("a one-key mapping: shared, pool or unique", value)
    kind, body = next(iter(value.items()))
    if kind not in ("shared", "pool", "unique"):
        raise where.fail("a segment kind: shared, pool or unique", kind)
    where = where / kind
    body = {} if body is None else body
    allowed = {
        "shared": ("name", "length", "variants", "weights"),
        "pool": ("name", "length", "size", "pick", "popularity", "order"),
        "unique": ("name", "length"),
    }[kind]
    m = mapping(body, where, allowed)
    name = string(get(m, "name", where, f"{prefix}{kind}{index}"), where / "name")
    length = parse_dist(get(m, "length", where), where / "length", integer_valued=True, minimum=1)
    if kind == "shared":
        variants = integer(get(m, "variants", where, 1), where / "variants", minimum=1)
        weights = parse_weights(get(m, "weights", where, None), where / "weights", variants)
        return Segment(kind, name, length, variants=variants, weights=tuple(weights))
    if kind == "pool":
        size = integer(get(m, "size", where), where / "size", minimum=1)
        pick = parse_dist(get(m, "pick", where, 1), where / "pick", integer_valued=True, minimum=1)
        popularity = parse_weights(get(m, "popularity", where, None), where / "popularity", size)
        order = string(get(m, "order", where, "random"), where / "order", ("random", "sorted"))
        return Segment(
            kind, name, length, size=size, pick=pick, order=order, weights=tuple(popularity)
        )
    return Segment(kind, name, length)


def _names(value: Any, where: Where, prefix: str) -> tuple[str | None, ...]:
    """Tenant or adapter names: a list of distinct names (or nulls), or a count N that names
    ``{prefix}-0 .. {prefix}-(N-1)`` (1: one unnamed)."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = integer(value, where, minimum=1)
        return tuple(f"{prefix}-{i}" for i in range(count)) if count > 1 else (None,)
    items = sequence(value, where, min_len=1)
    out: list[str | None] = []
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, str):
            raise (where / i).fail("a name (string) or null for none", item)
        out.append(item)
    if len(set(out)) != len(out):
        raise where.fail("distinct names", value)
    return tuple(out)


def _namespace(value: Any, where: Where) -> NamespaceMix:
    """The ``namespace`` mapping, checked."""
    m = mapping(
        value,
        where,
        ("model", "tenants", "tenant_weights", "adapters", "adapter_weights", "adapter_version"),
    )
    tenants = _names(get(m, "tenants", where, 1), where / "tenants", "tenant")
    adapters = _names(get(m, "adapters", where, [None]), where / "adapters", "adapter")
    tw = parse_weights(
        get(m, "tenant_weights", where, None), where / "tenant_weights", len(tenants)
    )
    aw = parse_weights(
        get(m, "adapter_weights", where, None), where / "adapter_weights", len(adapters)
    )
    version = get(m, "adapter_version", where, None)
    return NamespaceMix(
        model=string(get(m, "model", where, ""), where / "model"),
        tenants=tenants,
        tenant_weights=tuple(np.asarray(tw).tolist()),
        adapters=adapters,
        adapter_weights=tuple(np.asarray(aw).tolist()),
        adapter_version=None if version is None else string(version, where / "adapter_version"),
    )


def _session(value: Any, where: Where) -> Session:
    """The ``session`` mapping, checked."""
    m = mapping(value, where, ("turns", "think_time_s", "keep_output", "turn", "max_context"))
    turn_where = where / "turn"
    turn = tuple(
        _segment(s, turn_where / i, i, prefix="turn-")
        for i, s in enumerate(sequence(get(m, "turn", where), turn_where, min_len=1))
    )
    max_context = get(m, "max_context", where, None)
    return Session(
        turns=parse_dist(get(m, "turns", where), where / "turns", integer_valued=True, minimum=1),
        think_time_s=parse_dist(
            get(m, "think_time_s", where, 0),
            where / "think_time_s",
            integer_valued=False,
            minimum=0,
        ),
        keep_output=boolean(get(m, "keep_output", where, True), where / "keep_output"),
        turn=turn,
        max_context=None
        if max_context is None
        else integer(max_context, where / "max_context", minimum=1),
    )
