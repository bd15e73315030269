"""What watches the routes, behind one object (``RouteObservers``): the live what-if curves (a
sample of every routed prompt's blocks), the trace recorder (every routed prompt, for offline
replay) and the counterfactual replay of that trace (a job run on request, off the route path).

The router calls ``observe`` after each route it decides (``Router.attach_observer``, only when
an observer wants routes: the curves on or a trace recorded); ``GET /v1/whatif`` answers
``report``; the app's stop calls ``close``. The parts are built by ``assembly.build_service``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.fleet.whatif.counterfactual_replay import CounterfactualReplay
from prefixcache.fleet.whatif.live_curves import LiveCurves
from prefixcache.fleet.whatif.trace_recorder import TraceRecorder


class RouteObservers:
    """The route's observers: ``curves`` (always present, for ``/v1/whatif`` and the metrics;
    fed only when ``whatif.enabled``), ``recorder`` (None: no trace recorded) and
    ``counterfactuals`` (the replay jobs over the recorded trace)."""

    def __init__(
        self,
        curves: LiveCurves,
        recorder: TraceRecorder | None,
        counterfactuals: CounterfactualReplay,
    ) -> None:
        self.curves = curves
        self.recorder = recorder
        self.counterfactuals = counterfactuals
        self._sampled = curves if curves.config.enabled else None  # fed by every route

    @property
    def watching(self) -> bool:
        """Whether any observer wants each route (if not, the router need not call)."""
        return self._sampled is not None or self.recorder is not None

    def observe(
        self, replica: str, digests: Sequence[bytes], prompt_tokens: int, block_size: int
    ) -> None:
        """One route: the prompt (its full blocks' digests at the chosen replica's
        ``block_size``, root first) went to ``replica``; runs on the routing thread."""
        if self._sampled is not None:
            self._sampled.observe(replica, digests, prompt_tokens, block_size)
        if self.recorder is not None:
            self.recorder.record(digests, prompt_tokens, block_size)

    def report(self) -> dict[str, Any]:
        """What the observers say now, as ``GET /v1/whatif`` answers it: the live curves and
        the last counterfactual job's state and answers (under ``counterfactuals``)."""
        body = self.curves.snapshot()
        body["counterfactuals"] = self.counterfactuals.report()
        return body

    def close(self) -> None:
        """Stop a running counterfactual job, then flush and close the recorded trace (the
        service stops); blocks until the job's replay has ended."""
        self.counterfactuals.close()
        if self.recorder is not None:
            self.recorder.close()
