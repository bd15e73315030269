"""Values of a scenario file: typed fields, distributions of lengths and times, and weights.

Every field is read through a ``Where`` (the file and a dotted path like ``prompt[1].length``),
so a failure names the file, the field and what was expected.

A distribution is either a plain number (fixed) or ``{dist: NAME, ...}``; every form takes
optional ``min`` / ``max`` clips. Draws come from numpy in chunks, so one draw costs a list pop.

Every check raises ``ScenarioError`` (a ``ConfigError``) naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from prefixcache.replay.workload.input_errors import UNSET, ScenarioError


class Where:
    """A position in a scenario file: the file and a dotted field path like ``prompt[1].length``
    (empty: the top level). ``where / "key"`` and ``where / 1`` name a field or item in it."""

    def __init__(self, file: str, path: str = "") -> None:
        self.file, self.path = file, path

    def __truediv__(self, key: str | int) -> Where:
        """The position of field ``key`` (a str) or item ``key`` (an int) below this one."""
        if isinstance(key, int):
            return Where(self.file, f"{self.path}[{key}]")
        return Where(self.file, f"{self.path}.{key}" if self.path else key)

    def fail(self, expected: str, got: Any = UNSET) -> ScenarioError:
        """The ScenarioError (returned, to be raised) for this position: what was
        ``expected``, and what was given unless ``got`` is left out."""
        return ScenarioError(self.file, self.path or "(top level)", expected, got)


def mapping(value: Any, where: Where, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    """``value`` itself when it is a mapping whose keys are all in ``allowed``; ScenarioError
    when it is not a mapping or has another key (naming the first)."""
    if not isinstance(value, Mapping):
        raise where.fail("a mapping", value)
    for key in value:
        if key not in allowed:
            raise (where / str(key)).fail(f"no such field (allowed: {', '.join(allowed)})")
    return value


def get(m: Mapping[str, Any], key: str, where: Where, default: Any = UNSET) -> Any:
    """``m[key]``, or ``default`` when the key is missing or null; with no default the field is
    required and its absence raises ScenarioError (``where`` is the mapping's position)."""
    if key in m and m[key] is not None:
        return m[key]
    if default is UNSET:
        raise (where / key).fail("a value (the field is required)")
    return default


def integer(value: Any, where: Where, minimum: int | None = None) -> int:
    """``value`` as an int: an int, or a float with an integral value (``4.0``), never a bool;
    ScenarioError when it is not one or is below ``minimum`` (None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise where.fail(
                "an integer" + (f" >= {minimum}" if minimum is not None else ""), value
            )
    if minimum is not None and value < minimum:
        raise where.fail(f"an integer >= {minimum}", value)
    return value


def number(value: Any, where: Where, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` (an int or float, never a bool) as a finite float; ScenarioError when it is not
    one or is below ``minimum`` (at or below it when ``strict``; None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise where.fail("a number", value)
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise where.fail("a finite number", value) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise where.fail("a finite number", value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise where.fail(f"a number {'>' if strict else '>='} {minimum:g}", value)
    return value


def string(value: Any, where: Where, choices: tuple[str, ...] | None = None) -> str:
    """``value`` when it is a str (one of ``choices`` unless None); else ScenarioError."""
    if not isinstance(value, str):
        raise where.fail("a string" if choices is None else f"one of {', '.join(choices)}", value)
    if choices is not None and value not in choices:
        raise where.fail(f"one of {', '.join(choices)}", value)
    return value


def boolean(value: Any, where: Where) -> bool:
    """``value`` when it is a bool (``true`` / ``false``); else ScenarioError."""
    if not isinstance(value, bool):
        raise where.fail("true or false", value)
    return value


def sequence(value: Any, where: Where, min_len: int = 0) -> list[Any]:
    """``value`` when it is a list of at least ``min_len`` items; else ScenarioError."""
    if not isinstance(value, list):
        raise where.fail("a list", value)
    if len(value) < min_len:
        raise where.fail(f"a list of at least {min_len} item(s)", value)
    return value


# ---- distributions and weights ----------------------------------------------------------------


KINDS = ("fixed", "uniform", "normal", "lognormal", "exponential", "choice")  # dist: names
_COMMON = ("dist", "min", "max")
_PARAMS = {  # the parameters each kind takes (lognormal: median or mean, and sigma)
    "fixed": ("value",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std"),
    "lognormal": ("median", "mean", "sigma"),
    "exponential": ("mean",),
    "choice": ("values", "weights"),
}


@dataclass(frozen=True)
class Dist:
    """A validated distribution of a length, count or time (``parse_dist``)."""

    kind: str  # one of KINDS
    params: tuple[tuple[str, Any], ...]  # (name, value) of its parameters, as _PARAMS names them
    lo: float  # draws are clipped to [lo, hi]
    hi: float | None  # None: no upper clip (parse_dist always sets one)
    integer: bool  # draws are rounded to whole numbers

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` draws from ``rng`` as a float64 array, rounded to whole numbers when
        ``integer``, then clipped to ``[lo, hi]``."""
        p = dict(self.params)
        k = self.kind
        if k == "fixed":
            x = np.full(size, p["value"], dtype=float)
        elif k == "uniform":
            if self.integer:
                x = rng.integers(int(p["low"]), int(p["high"]) + 1, size).astype(float)
            else:
                x = rng.uniform(p["low"], p["high"], size)
        elif k == "normal":
            x = rng.normal(p["mean"], p["std"], size)
        elif k == "lognormal":
            sigma = p["sigma"]
            mu = np.log(p["median"]) if "median" in p else np.log(p["mean"]) - sigma**2 / 2
            x = rng.lognormal(mu, sigma, size)
        elif k == "exponential":
            x = rng.exponential(p["mean"], size)
        else:  # choice
            weights = np.asarray(p["weights"], dtype=float) if "weights" in p else None
            probs = None if weights is None else weights / weights.sum()
            x = rng.choice(np.asarray(p["values"], dtype=float), size=size, p=probs)
        if self.integer:
            x = np.rint(x)
        return np.clip(x, self.lo, self.hi)

    def sampler(self, rng: np.random.Generator) -> Callable[[], Any]:
        """A zero-argument function returning the next draw from ``rng`` (an int for integer
        distributions, else a float); a ``fixed`` one returns its value without drawing."""
        if self.kind == "fixed":
            value = self.draw(rng, 1)[0]
            const = int(value) if self.integer else float(value)
            return lambda: const
        return _Chunked(self, rng).next


class _Chunked:
    """Draws of one distribution, taken from numpy 4096 at a time (``next`` returns one)."""

    __slots__ = ("_buf", "_dist", "_rng")

    def __init__(self, dist: Dist, rng: np.random.Generator) -> None:
        self._dist, self._rng = dist, rng
        self._buf: list[Any] = []

    def next(self) -> Any:
        if not self._buf:
            x = self._dist.draw(self._rng, 4096)
            values = x.astype(np.int64).tolist() if self._dist.integer else x.tolist()
            values.reverse()  # pop() from the end keeps draw order
            self._buf = values
        return self._buf.pop()


def parse_dist(value: Any, where: Where, *, integer_valued: bool, minimum: float) -> Dist:
    """Parse a number (fixed) or a ``{dist: ...}`` mapping; draws never go below ``minimum``.
    Counts (``integer_valued``: token lengths, turns) draw whole numbers, and no value, ``min``
    or ``max`` of theirs may pass ``MAX_COUNT``, which is also their upper clip when no ``max``
    is given; times are clipped at ``MAX_SECONDS``. Raises ScenarioError naming the parameter
    that is wrong."""
    dist = _parse_dist(value, where, integer_valued=integer_valued, minimum=minimum)
    if not integer_valued:  # times: a heavy tail must not draw infinity
        return dist if dist.hi is not None else replace(dist, hi=MAX_SECONDS)
    for name, v in dist.params:
        for x in v if isinstance(v, list) else [v]:
            if name != "weights" and x > MAX_COUNT:
                raise (where if dist.kind == "fixed" and not isinstance(value, dict) else
                       where / name).fail(f"a number <= {MAX_COUNT:,}", x)  # fmt: skip
    if dist.hi is not None and dist.hi > MAX_COUNT:
        raise (where / "max").fail(f"a number <= {MAX_COUNT:,}", dist.hi)
    if dist.lo > MAX_COUNT:  # every draw would be cut below its own minimum
        raise (where / "min").fail(f"a number <= {MAX_COUNT:,}", dist.lo)
    # a heavy tail (lognormal with a large sigma) is cut at MAX_COUNT, not cast from infinity
    return dist if dist.hi is not None else replace(dist, hi=float(MAX_COUNT))


MAX_COUNT = 1 << 21  # the largest token length or count a scenario may draw (2,097,152)
MAX_SECONDS = 1e12  # the longest time a scenario may draw


def _parse_dist(value: Any, where: Where, *, integer_valued: bool, minimum: float) -> Dist:
    """``parse_dist`` without the bounds on counts and times."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        v = number(value, where, minimum=minimum)
        if integer_valued:
            v = float(integer(value, where, minimum=int(minimum)))
        return Dist("fixed", (("value", v),), minimum, None, integer_valued)
    kind = get(value if isinstance(value, dict) else {}, "dist", where, None)
    if kind not in KINDS:
        raise (where / "dist" if isinstance(value, dict) else where).fail(
            f"a number or a mapping with dist: one of {', '.join(KINDS)}", kind or value
        )
    m = mapping(value, where, _COMMON + _PARAMS[kind])
    lo = number(get(m, "min", where, minimum), where / "min", minimum=minimum)
    hi_raw = get(m, "max", where, None)
    hi = None if hi_raw is None else number(hi_raw, where / "max", minimum=lo)
    params: dict[str, Any] = {}
    if kind == "fixed":
        params["value"] = number(get(m, "value", where), where / "value", minimum=minimum)
    elif kind == "uniform":
        params["low"] = number(get(m, "low", where), where / "low", minimum=minimum)
        params["high"] = number(get(m, "high", where), where / "high", minimum=params["low"])
    elif kind == "normal":
        params["mean"] = number(get(m, "mean", where), where / "mean")
        params["std"] = number(get(m, "std", where), where / "std", minimum=0)
    elif kind == "lognormal":
        if ("median" in m) == ("mean" in m):
            raise where.fail("exactly one of median or mean (with sigma)")
        key = "median" if "median" in m else "mean"
        params[key] = number(m[key], where / key, minimum=0, strict=True)
        params["sigma"] = number(get(m, "sigma", where), where / "sigma", minimum=0)
    elif kind == "exponential":
        params["mean"] = number(get(m, "mean", where), where / "mean", minimum=0, strict=True)
    else:
        values = sequence(get(m, "values", where), where / "values", min_len=1)
        params["values"] = [
            number(v, where / "values" / i, minimum=minimum) for i, v in enumerate(values)
        ]
        if "weights" in m:
            params["weights"] = parse_weight_list(m["weights"], where / "weights", len(values))
    return Dist(kind, tuple(params.items()), lo, hi, integer_valued)


def parse_weight_list(value: Any, where: Where, count: int) -> list[float]:
    """A list of ``count`` weights (numbers >= 0 with a positive sum), returned as given (not
    normalized); ScenarioError otherwise."""
    items = sequence(value, where)
    if len(items) != count:
        raise where.fail(f"a list of {count} weights (one per item)", value)
    weights = [number(w, where / i, minimum=0) for i, w in enumerate(items)]
    if sum(weights) <= 0:
        raise where.fail("weights with a positive sum", value)
    return weights


def parse_weights(value: Any, where: Where, count: int) -> np.ndarray:
    """Selection probabilities over ``count`` items, as a float array summing to 1: from
    ``uniform`` (or None), ``{zipf: s}`` (item i has weight 1/(i+1)**s, s >= 0) or a list of
    ``count`` weights; ScenarioError for anything else."""
    if value is None or value == "uniform":
        w = np.ones(count)
    elif isinstance(value, dict) and set(value) == {"zipf"}:
        s = number(value["zipf"], where / "zipf", minimum=0)
        w = 1.0 / np.arange(1, count + 1, dtype=float) ** s
    elif isinstance(value, list):
        w = np.asarray(parse_weight_list(value, where, count))
    else:
        raise where.fail("uniform, {zipf: EXPONENT} or a list of weights", value)
    return w / w.sum()
