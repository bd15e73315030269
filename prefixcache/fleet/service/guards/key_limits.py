"""Per-key limits: a token bucket on lookups, routes and proxied requests, and a cap on the request
ids a key has in flight. Without API keys, every caller shares the one anonymous key's limits.

All of it runs on the event loop (the handlers call it before and after their work in the
thread pool), so it needs no lock. A refusal raises ``TooManyRequestsError`` (HTTP 429 with
``Retry-After``) and is counted in ``prefixcache_rejected_requests``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prefixcache.fleet.service.configuration.access_config import AccessConfig
from prefixcache.fleet.service.guards.access import Caller
from prefixcache.fleet.service.http_errors import TooManyRequestsError
from prefixcache.fleet.service.metrics import ServiceMetrics


@dataclass
class _KeyState:
    tokens: float  # of the rate limit's bucket
    stamp: float  # when ``tokens`` was last brought up to date
    live: set[str] = field(default_factory=set)  # router ids routed and maybe still in flight
    pending: int = 0  # routes admitted and not yet answered


class KeyLimits:
    """The rate and in-flight limits of every key."""

    def __init__(
        self,
        access: AccessConfig,
        metrics: ServiceMetrics,
        in_flight_among: Callable[[Iterable[str]], set[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = access.rate_per_s
        self.burst = float(
            access.burst if access.burst is not None else max(1, math.ceil(self.rate or 1))
        )
        self.cap = access.max_in_flight_per_key
        self._metrics = metrics
        self._in_flight_among = in_flight_among
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}  # by key label: as many as configured keys

    def _state(self, caller: Caller) -> _KeyState:
        state = self._keys.get(caller.label)
        if state is None:
            state = self._keys[caller.label] = _KeyState(self.burst, self._clock())
        return state

    def take(self, caller: Caller) -> None:
        """Spend one request of ``caller``'s rate; TooManyRequestsError when none is left."""
        rate = self.rate
        if rate is None:
            return
        state = self._state(caller)
        now = self._clock()
        state.tokens = min(self.burst, state.tokens + (now - state.stamp) * rate)
        state.stamp = now
        if state.tokens < 1.0:
            self._metrics.rejected.labels("rate_limited", caller.label).inc()
            wait = (1.0 - state.tokens) / rate
            raise TooManyRequestsError(
                f"key {caller.label!r} is over its rate limit of {rate:g} requests per second; "
                f"retry in {wait:.2f} s",
                wait,
            )
        state.tokens -= 1.0

    def reserve(self, caller: Caller) -> None:
        """Hold a place for a route with a request id; TooManyRequestsError when ``caller``
        already has its cap of ids in flight. ``settle`` must follow."""
        if self.cap is None:
            return
        state = self._state(caller)
        if len(state.live) + state.pending >= self.cap:
            state.live = self._in_flight_among(state.live)  # drop released and expired ids
            if len(state.live) + state.pending >= self.cap:
                self._metrics.rejected.labels("in_flight_limit", caller.label).inc()
                raise TooManyRequestsError(
                    f"key {caller.label!r} has {self.cap} request ids in flight, its limit; "
                    "release some first"
                )
        state.pending += 1

    def settle(self, caller: Caller, routed_id: str | None) -> None:
        """The reserved route ended: ``routed_id`` is in flight now (None: it failed)."""
        if self.cap is None:
            return
        state = self._state(caller)
        state.pending -= 1
        if routed_id is not None:
            state.live.add(routed_id)

    def forget(self, caller: Caller, routed_id: str) -> None:
        """``routed_id`` was released."""
        if self.cap is not None:
            self._state(caller).live.discard(routed_id)
