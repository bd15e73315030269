"""Arrival-time scaling: replay a workload faster or slower than recorded.

``--rate-scale 2`` halves every arrival time (twice the request rate, as vLLM's benchmark
``--request-rate`` raises the rate); ``--time-scale 2`` doubles them (the trace stretched to twice
its span). Both apply together: each arrival time is multiplied by ``time_scale / rate_scale``.
Every arrival, scaled or not, must stay within ``MAX_TIME_S``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prefixcache.errors import ConfigError
from prefixcache.replay.workload.request import Request

MAX_TIME_S = 1e12  # arrival times in seconds: Unix epochs in s or ms fit, 1e300 does not


class ScaledArrivals:
    """The requests of ``requests`` with every arrival time multiplied by ``factor``
    (``time_scale / rate_scale``; 1.0 yields the requests themselves); iterable as often as
    ``requests`` is. Nothing is checked until iteration."""

    def __init__(self, requests: Iterable[Request], factor: float) -> None:
        self.requests, self.factor = requests, factor

    def __iter__(self) -> Iterator[Request]:
        """Each request, its arrival time (seconds) scaled. Raises ConfigError, naming the
        request's 1-based position, at the first arrival past ``MAX_TIME_S`` or NaN."""
        f = self.factor
        if f == 1.0:  # the requests themselves, each still checked
            for k, r in enumerate(self.requests):
                if not r.arrival_s <= MAX_TIME_S:
                    raise _too_late(k, r.arrival_s, f)
                yield r
            return
        for k, r in enumerate(self.requests):
            arrival = r.arrival_s * f
            if not arrival <= MAX_TIME_S:  # a tiny rate, or a large scale: no simulated clock
                raise _too_late(k, arrival, f)
            yield r._replace(arrival_s=arrival)


def _too_late(k: int, arrival: float, f: float) -> ConfigError:
    """The error for request ``k`` (0-based) arriving at ``arrival`` s after scaling by ``f``."""
    return ConfigError(
        f"request {k + 1} would arrive at {arrival:g} s"
        + ("" if f == 1.0 else f" (scaled by {f:g})")
        + f", past {MAX_TIME_S:g} s: raise the arrival rate (or --rate-scale), "
        "or lower --time-scale"
    )
