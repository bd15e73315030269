"""Requests of a scenario, generated lazily in arrival order; the same seed gives the same ones.

Every random choice draws from its own generator keyed by what it is for (a segment's name, the
arrivals, the outputs), so adding a segment leaves the draws of the others unchanged. Token ids
come from counter-based streams (``synth``): a shared segment is the same array for every
request, a unique one is a fresh slice of its stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.scenario import Arrivals, Scenario, Segment
from prefixcache.replay.workload.synth import TokenTape, stream_key, stream_tokens


def _rng(seed: int, *parts: object) -> np.random.Generator:
    """The generator of the draws named by ``parts`` under ``seed``."""
    return np.random.default_rng([seed, stream_key(*parts) & 0xFFFFFFFF])


class _Picker:
    """Categorical draws over ``len(probs)`` items, in chunks."""

    def __init__(self, probs: tuple[float, ...], rng: np.random.Generator) -> None:
        self._p = np.asarray(probs)
        self._rng = rng
        self._buf: list[int] = []

    def __call__(self) -> int:
        if len(self._p) == 1:
            return 0
        if not self._buf:
            self._buf = self._rng.choice(len(self._p), size=4096, p=self._p).tolist()[::-1]
        return self._buf.pop()


class _SegmentSource:
    """Appends one segment's tokens for a request to a list of arrays."""

    def __init__(self, seg: Segment, sc: Scenario, seed: int, tapes: dict[str, TokenTape]) -> None:
        self.seg, self.vocab, self.seed = seg, sc.vocab_size, seed
        if seg.kind == "unique":
            if seg.name not in tapes:
                tapes[seg.name] = TokenTape(stream_key(seed, "unique", seg.name), sc.vocab_size)
            self._tape = tapes[seg.name]
            self._length = seg.length.sampler(_rng(seed, "length", seg.name))
            return
        count = seg.variants if seg.kind == "shared" else seg.size
        # Each item (variant or pool entry) has one length, drawn once.
        lengths = seg.length.draw(_rng(seed, "length", seg.name), count).astype(np.int64)
        self._lengths = lengths.tolist()
        self._items: dict[int, np.ndarray] = {}
        self._pick_item = _Picker(seg.weights, _rng(seed, "pick", seg.name))
        if seg.kind == "pool":
            assert seg.pick is not None
            self._count = seg.pick.sampler(_rng(seed, "count", seg.name))
            self._fill_rng = _rng(seed, "fill", seg.name)

    def item(self, i: int) -> np.ndarray:
        """The tokens of variant or pool item ``i`` (built once, then the same array)."""
        tokens = self._items.get(i)
        if tokens is None:
            key = stream_key(self.seed, self.seg.kind, self.seg.name, i)
            tokens = self._items[i] = stream_tokens(key, self._lengths[i], self.vocab)
        return tokens

    def emit(self, out: list[np.ndarray]) -> None:
        """Append this segment's tokens for the next request to ``out``."""
        kind = self.seg.kind
        if kind == "unique":
            out.append(self._tape.take(self._length()))
        elif kind == "shared":
            out.append(self.item(self._pick_item()))
        else:
            want = min(self._count(), self.seg.size)
            chosen: dict[int, None] = {}
            for _ in range(8 * want):  # distinct items, in the order drawn
                chosen[self._pick_item()] = None
                if len(chosen) == want:
                    break
            if len(chosen) < want:  # very skewed popularity: the rest without replacement
                chosen.update(dict.fromkeys(self._fill(chosen, want - len(chosen))))
            ids = sorted(chosen) if self.seg.order == "sorted" else list(chosen)
            out.extend(self.item(i) for i in ids)

    def _fill(self, chosen: dict[int, None], k: int) -> list[int]:
        """``k`` more distinct items, none of ``chosen``, drawn by popularity."""
        p = np.asarray(self.seg.weights).copy()
        p[list(chosen)] = 0.0
        left = np.flatnonzero(p)
        k = min(k, len(left))
        if k == 0:
            return []
        picked = self._fill_rng.choice(left, size=k, replace=False, p=p[left] / p[left].sum())
        return [int(i) for i in picked]


def _clock(arrivals: Arrivals, rng: np.random.Generator) -> Iterator[float]:
    """Arrival times in seconds (of sessions when the scenario has sessions)."""
    if arrivals.process == "timestamps":
        yield from arrivals.timestamps
        return
    t, i = 0.0, 0
    while True:
        if arrivals.process == "constant":
            yield i / arrivals.rate
            i += 1
            continue
        if arrivals.process == "poisson":
            gaps = rng.exponential(1.0 / arrivals.rate, 4096)
        else:  # gamma: shape 1/cv^2 keeps the mean gap at 1/rate
            shape = 1.0 / arrivals.cv**2
            gaps = rng.gamma(shape, 1.0 / (arrivals.rate * shape), 4096)
        for gap in gaps.tolist():
            yield t
            t += gap


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """The parts as one array (the part itself when there is one)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Workload:
    """The request stream of a scenario, drawn with ``seed`` (None: the scenario's). Iterate
    it any number of times: the same requests each time, in arrival order (a session's turns
    interleaved with other sessions'), until ``requests`` were made, the next would arrive
    after ``duration_s``, or the timestamps run out. Shared prompt parts are the same array in
    every request that has them: read, never write, a request's tokens."""

    def __init__(self, scenario: Scenario, seed: int | None = None) -> None:
        self.scenario = scenario
        self.seed = scenario.seed if seed is None else seed

    @property
    def namespaces(self) -> list[Namespace]:
        """Every namespace requests may come in, tenant by tenant, adapter by adapter: the
        scenario's model, the adapter (versioned when it has one) and the tenant as the salt."""
        mix = self.scenario.namespace
        return [
            Namespace(
                model=mix.model,
                adapter=a,
                adapter_version=mix.adapter_version if a else None,
                salt=t,
            )
            for t in mix.tenants
            for a in mix.adapters
        ]

    def __iter__(self) -> Iterator[Request]:
        """The requests, generated lazily."""
        sc, seed = self.scenario, self.seed
        tapes: dict[str, TokenTape] = {}
        prompt = [_SegmentSource(s, sc, seed, tapes) for s in sc.prompt]
        output_len = sc.output.sampler(_rng(seed, "output"))
        pick_ns = self._namespace_picker()
        clock = _clock(sc.arrivals, _rng(seed, "arrivals"))
        limit = sc.requests if sc.requests is not None else float("inf")
        horizon = sc.duration_s if sc.duration_s is not None else float("inf")
        if sc.session is None:
            n = sc.n
            for count, t in enumerate(clock):
                if count >= limit or t > horizon:
                    return
                parts: list[np.ndarray] = []
                for seg in prompt:
                    seg.emit(parts)
                yield Request(t, _concat(parts), output_len(), pick_ns(), n)
            return
        yield from self._sessions(prompt, output_len, pick_ns, clock, limit, horizon, tapes)

    def _sessions(
        self,
        prompt: list[_SegmentSource],
        output_len: Callable[[], int],
        pick_ns: Callable[[], Namespace],
        clock: Iterator[float],
        limit: float,
        horizon: float,
        tapes: dict[str, TokenTape],
    ) -> Iterator[Request]:
        """The requests of a scenario with sessions: turns kept in a heap by arrival time."""
        sc, seed = self.scenario, self.seed
        spec = sc.session
        assert spec is not None
        turn = [_SegmentSource(s, sc, seed, tapes) for s in spec.turn]
        turns = spec.turns.sampler(_rng(seed, "turns"))
        think = spec.think_time_s.sampler(_rng(seed, "think"))
        outputs = TokenTape(stream_key(seed, "output-tokens"), sc.vocab_size)
        # heap of (arrival, order, context before this turn's new segments, namespace, turns left)
        pending: list[tuple[float, int, np.ndarray | None, Namespace, int]] = []
        order = 0
        next_start = next(clock, None)
        emitted = 0
        while emitted < limit:
            if next_start is not None and (not pending or next_start <= pending[0][0]):
                heapq.heappush(pending, (next_start, order, None, pick_ns(), turns()))
                order += 1
                next_start = next(clock, None)
                continue
            if not pending:
                return
            t, _, context, ns, left = heapq.heappop(pending)
            if t > horizon:
                return
            parts: list[np.ndarray] = [] if context is None else [context]
            for seg in prompt if context is None else turn:
                seg.emit(parts)
            tokens = _concat(parts)
            cap = spec.max_context
            if context is not None and cap is not None and len(tokens) > cap:
                continue  # this turn would pass the cap: the session ends
            out_len = output_len()
            more = left > 1
            out_tokens = None
            if more and spec.keep_output and out_len:
                out_tokens = outputs.take(out_len)
            yield Request(t, tokens, out_len, ns, sc.n, out_tokens)
            emitted += 1
            if more:
                ctx = tokens if out_tokens is None else np.concatenate([tokens, out_tokens])
                if spec.max_context is None or len(ctx) < spec.max_context:
                    heapq.heappush(pending, (t + think(), order, ctx, ns, left - 1))
                    order += 1

    def _namespace_picker(self) -> Callable[[], Namespace]:
        """A function drawing each request's namespace: tenant and adapter by their weights."""
        mix = self.scenario.namespace
        spaces = self.namespaces
        if len(spaces) == 1:
            only = spaces[0]
            return lambda: only
        tenant = _Picker(mix.tenant_weights, _rng(self.seed, "tenant"))
        adapter = _Picker(mix.adapter_weights, _rng(self.seed, "adapter"))
        width = len(mix.adapters)
        return lambda: spaces[tenant() * width + adapter()]
