"""Arrival-time scaling: replay a workload faster or slower than recorded.

``--rate-scale 2`` halves every arrival time (twice the request rate, as vLLM's benchmark
``--request-rate`` raises the rate); ``--time-scale 2`` doubles them (the trace stretched to twice
its span). Both apply together: each arrival time is multiplied by ``time_scale / rate_scale``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prefixcache.replay.request import Request


class ScaledArrivals:
    """The requests of ``requests`` with every arrival time multiplied by ``factor``; iterable
    as often as ``requests`` is."""

    def __init__(self, requests: Iterable[Request], factor: float) -> None:
        self.requests, self.factor = requests, factor

    def __iter__(self) -> Iterator[Request]:
        """Each request, its arrival time scaled."""
        f = self.factor
        if f == 1.0:
            yield from self.requests
            return
        for r in self.requests:
            yield r._replace(arrival_s=r.arrival_s * f)
