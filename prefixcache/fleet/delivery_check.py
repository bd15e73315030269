"""Predicted against delivered: what the router expected a replica to serve from its cache, next
to what the engine reports it served, per request; a replica whose reports stay off the
predictions is ``degraded``, with a reason a person can act on; and where each request's reuse
went (available, captured, delivered), per tenant and model.

A prediction is the chosen replica's cached tokens at route time, capped as engines cap a hit:
vLLM and SGLang always compute a prompt's last token, so a fully cached prompt reports at most
its whole blocks before the last token (``engine_cap``). The engine's figure is
``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
SGLang with ``--enable-cache-report``) or, in route-API mode, what the gateway reports back.

Per replica the last ``window`` reported requests are kept. The engine's figure is compared in
whole blocks of the replica's ``block_size`` (rounded down): an engine that reuses part of a
block (SGLang with ``--page-size 1`` matches token by token, up to the prompt's last token)
reports a few tokens past its whole blocks, which the index, made of whole blocks, never
predicts. Off by more than a block counts:

- **under**: the index predicted a hit the engine did not deliver (hashes that differ: block
  size, algorithm, seed or salt handling; an engine restarted empty without telling);
- **over**: the engine served hits the index did not know (its KV events do not reach the
  service, or are not understood).

With at least ``min_requests`` in the window, a replica goes ``degraded`` when either share
reaches ``tolerance`` (of the requests with a predicted hit for under, of all for over) and
clears when both fall below half of it: a sliding window, so it clears by itself once they
agree again. The reason is read from the window as it is (``delivery_reason``): its counts are
the window's now, and while the replica stays degraded its cause is what the window shows now
(a fault that changes, from hits not delivered to hits the index never heard of, changes it,
with a log line). Not thread-safe on its own: ``DeliveryCheck`` takes its lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger("prefixcache.fleet")


@dataclass(frozen=True)
class DeliveryConfig:
    """When a replica's delivered cached tokens count as off the predictions."""

    enabled: bool = True  # False: no predictions kept, no answer read, no verdicts
    window: int = 300  # reported requests kept per replica
    min_requests: int = 50  # no verdict on fewer
    tolerance: float = 0.5  # share of requests off by more than a block that degrades
    max_pending: int = 100_000  # routed requests awaiting a report (route-API mode), oldest out


class Prediction(NamedTuple):
    """What routing knew of one request when it chose the replica."""

    replica: str
    tenant: str  # the caller's tenant ("" without keys)
    model: str
    block_size: int  # the chosen replica's
    prompt_tokens: int
    available: int  # the most any eligible replica held
    captured: int  # what the chosen replica held


class Attribution(NamedTuple):
    """Where reuse went, summed over reported requests (one tenant and model)."""

    requests: int
    prompt_tokens: int
    available_tokens: int  # the best any replica held when routed
    captured_tokens: int  # what the chosen replica held
    delivered_tokens: int  # what the engine reported serving from its cache


class DeliveryState(NamedTuple):
    """One replica's predictions against its engine's reports, over the window."""

    replica: str
    degraded: bool
    reason: str  # what is off and what to check ("" while they agree)
    requests: int  # reported requests in the window
    predicted_hits: int  # of those, with a predicted hit
    under: int  # predicted hits the engine did not deliver (off by more than a block)
    over: int  # engine hits the index did not know (off by more than a block)
    mean_predicted: float  # cached tokens, over the window
    mean_delivered: float
    degraded_times: int  # times it went degraded so far


def engine_cap(prompt_tokens: int, cached: int, block_size: int) -> int:
    """``cached`` as an engine can report it: whole blocks before the prompt's last token."""
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    return min(cached, (prompt_tokens - 1) // block_size * block_size)


class _Sample(NamedTuple):
    predicted: int
    delivered: int
    predicted_hit: bool
    under: bool
    over: bool


class _ReplicaWindow:
    """The last ``window`` samples of one replica, with their counts kept as they come and go
    (a verdict per report costs O(1), not a pass over the window)."""

    __slots__ = (
        "causes",
        "degraded",
        "degraded_times",
        "over",
        "predicted_hits",
        "samples",
        "sum_delivered",
        "sum_predicted",
        "under",
    )

    def __init__(self, window: int) -> None:
        self.samples: deque[_Sample] = deque(maxlen=window)
        self.predicted_hits = self.under = self.over = 0
        self.sum_predicted = self.sum_delivered = 0
        self.degraded = False
        self.causes: tuple[str, ...] = ()  # what degrades it (UNDER, OVER), as the window shows
        self.degraded_times = 0

    def add(self, predicted: int, delivered: int, block_size: int) -> None:
        """One more report; the oldest leaves a full window."""
        samples = self.samples
        if len(samples) == samples.maxlen:
            self._count(samples[0], -1)
        # at block granularity: an engine that reuses part of a block (SGLang with page size 1)
        # reports tokens past its whole blocks, which the index never predicts
        whole = delivered // block_size * block_size if block_size > 0 else delivered
        sample = _Sample(
            predicted,
            delivered,
            predicted > 0,
            predicted > 0 and whole < predicted - block_size,
            whole > predicted + block_size,
        )
        samples.append(sample)
        self._count(sample, 1)

    def _count(self, s: _Sample, sign: int) -> None:
        self.predicted_hits += sign * s.predicted_hit
        self.under += sign * s.under
        self.over += sign * s.over
        self.sum_predicted += sign * s.predicted
        self.sum_delivered += sign * s.delivered

    def means(self) -> tuple[float, float]:
        """Mean predicted and delivered cached tokens over the window."""
        n = len(self.samples) or 1
        return self.sum_predicted / n, self.sum_delivered / n

    def shares(self) -> tuple[float, float]:
        """Under-delivered predicted hits over the predicted hits, and over-delivered requests
        over all, in the window."""
        n = len(self.samples)
        under = self.under / self.predicted_hits if self.predicted_hits else 0.0
        return under, self.over / n if n else 0.0


UNDER, OVER = "under", "over"


def delivery_reason(win: _ReplicaWindow, cfg: DeliveryConfig) -> str:
    """What is off in ``win`` now and what to check ("" while it is not degraded): read from
    the window as it is, so its counts and its cause follow the reports."""
    if not win.degraded:
        return ""
    mean_p, mean_d = win.means()
    under_share, over_share = win.shares()
    parts = []
    for cause in win.causes:
        share = under_share if cause == UNDER else over_share
        back = (
            f" (under the {cfg.tolerance:.0%} that degrades; it clears below "
            f"{cfg.tolerance / 2:.0%})"
            if share < cfg.tolerance
            else ""
        )
        if cause == UNDER:
            parts.append(
                f"predicted {mean_p:,.0f} cached tokens a request on average, the engine "
                f"reported {mean_d:,.0f}: less than predicted on {under_share:.0%} of "
                f"{win.predicted_hits} requests with a predicted hit{back}; check block_size, "
                "the hash algorithm and seed (engine_hash) and cache_salt handling against the "
                "engine's, and whether it restarted empty"
            )
        else:
            parts.append(
                f"the engine reported cached tokens the index did not know on "
                f"{over_share:.0%} of {len(win.samples)} requests ({mean_d:,.0f} a request on "
                f"average, {mean_p:,.0f} predicted){back}: its KV events do not reach the "
                "service or are not understood; check the events and replay endpoints, "
                "block_size and engine_hash"
            )
    return "; and ".join(parts)


class DeliveryCheck:
    """Predictions, the engines' reports, the per-replica verdicts and the attribution sums."""

    def __init__(self, config: DeliveryConfig | None = None) -> None:
        self.config = config or DeliveryConfig()
        self._lock = threading.Lock()
        self._windows: dict[str, _ReplicaWindow] = {}
        self._pending: OrderedDict[str, Prediction] = OrderedDict()
        self._sums: dict[tuple[str, str], list[int]] = {}
        self.unreported = 0  # requests whose answer carried no cached-token figure

    # ---- route-API mode: predictions wait for the gateway's report --------------------------
    def expect(self, request_id: str, prediction: Prediction) -> None:
        """Remember a routed request's prediction until its report (the oldest are dropped past
        ``max_pending``)."""
        if not self.config.enabled:
            return
        with self._lock:
            pending = self._pending
            pending[request_id] = prediction
            while len(pending) > self.config.max_pending:
                pending.popitem(last=False)

    def forget(self, request_id: str) -> Prediction | None:
        """Drop (and return) a request's prediction: released without a report."""
        with self._lock:
            return self._pending.pop(request_id, None)

    def report(self, request_id: str, delivered: int | None) -> bool:
        """The gateway's figure for a routed request (None: it has none); False when no
        prediction waits under that id."""
        prediction = self.forget(request_id)
        if prediction is None:
            return False
        self.observe(prediction, delivered)
        return True

    # ---- what the engines delivered ---------------------------------------------------------
    def observe(self, prediction: Prediction, delivered: int | None) -> None:
        """One request's engine figure (None: the answer had none) against its prediction."""
        if not self.config.enabled:
            return
        if delivered is None:
            with self._lock:
                self.unreported += 1
            return
        p = prediction
        predicted = engine_cap(p.prompt_tokens, p.captured, p.block_size)
        delivered = max(0, min(delivered, p.prompt_tokens))
        with self._lock:
            sums = self._sums.get((p.tenant, p.model))
            if sums is None:
                sums = self._sums[(p.tenant, p.model)] = [0, 0, 0, 0, 0]
            sums[0] += 1
            sums[1] += p.prompt_tokens
            sums[2] += max(p.available, p.captured)
            sums[3] += p.captured
            sums[4] += delivered
            win = self._windows.get(p.replica)
            if win is None:
                win = self._windows[p.replica] = _ReplicaWindow(self.config.window)
            win.add(predicted, delivered, p.block_size)
            self._judge(p.replica, win)

    def _judge(self, replica: str, win: _ReplicaWindow) -> None:
        """Degrade or clear ``replica`` on its window, and while it stays degraded name the
        cause its window shows now (one log line when its verdict or its cause turns)."""
        cfg = self.config
        n = len(win.samples)
        if n < cfg.min_requests:
            return
        under_share, over_share = win.shares()
        tripped = []
        if under_share >= cfg.tolerance and win.predicted_hits >= cfg.min_requests // 2:
            tripped.append(UNDER)
        if over_share >= cfg.tolerance:
            tripped.append(OVER)
        if not win.degraded:
            if not tripped:
                return
            win.degraded, win.causes = True, tuple(tripped)
            win.degraded_times += 1
            log.warning("replica %s degraded: %s", replica, delivery_reason(win, cfg))
        elif under_share < cfg.tolerance / 2 and over_share < cfg.tolerance / 2:
            win.degraded, win.causes = False, ()
            log.warning(
                "replica %s recovered: its engine delivers what the index predicts", replica
            )
        else:
            # still degraded: what trips now, else (on its way back) the larger share
            causes = tuple(tripped) or ((UNDER,) if under_share >= over_share else (OVER,))
            turned = not set(causes) <= set(win.causes)
            win.causes = causes
            if turned:
                log.warning(
                    "replica %s still degraded, now: %s", replica, delivery_reason(win, cfg)
                )

    # ---- reading ----------------------------------------------------------------------------
    def state(self, replica: str) -> DeliveryState:
        """The replica's verdict and the window's figures (an empty one before any report)."""
        with self._lock:
            win = self._windows.get(replica)
            if win is None:
                return DeliveryState(replica, False, "", 0, 0, 0, 0, 0.0, 0.0, 0)
            mean_p, mean_d = win.means()
            return DeliveryState(
                replica,
                win.degraded,
                delivery_reason(win, self.config),
                len(win.samples),
                win.predicted_hits,
                win.under,
                win.over,
                mean_p,
                mean_d,
                win.degraded_times,
            )

    def degraded(self) -> dict[str, str]:
        """Replica -> reason, for each degraded replica."""
        with self._lock:
            cfg = self.config
            return {
                name: delivery_reason(w, cfg) for name, w in self._windows.items() if w.degraded
            }

    def attribution(self) -> dict[tuple[str, str], Attribution]:
        """(tenant, model) -> the sums over reported requests."""
        with self._lock:
            return {key: Attribution(*sums) for key, sums in self._sums.items()}
