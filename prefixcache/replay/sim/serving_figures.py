"""Benchmark figures of a serving simulation, as vLLM's and SGLang's serving benchmarks print
them: request and token throughput, TTFT, TPOT and end-to-end latency, and the offered load.

TPOT (time per output token) is ``(end-to-end - TTFT) / (output tokens - 1)`` per request, over
requests with more than one output token; a request sampled ``n`` times in parallel counts the
tokens of one sample (its samples decode side by side, one token each per step). In this
simulation every decode step emits one token per sequence, so the mean inter-token latency (ITL)
equals the mean TPOT.

Offered load is the GPU's busy time (the sum of step times) over the arrival span (first to last
arrival). A GPU that always has a request in flight is busy even when it decodes a handful of
sequences, so busy time alone may exceed the span with no queue at all. The run is OVERLOADED when
the load is above 1 *and* the queue grew: the last tenth of the arrivals waited longer for their
first token than the first tenth by more than ``QUEUE_GROWTH`` of the arrival span. Then requests
arrive faster than they are served and TTFT grows for as long as the trace runs. A fleet reports
the mean load over its replicas and the busiest replica's; the busiest one decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.blocks.namespace import DEFAULT_NAMESPACE
from prefixcache.replay.workload.request import Request
from prefixcache.run_format import nearest_rank

OVERLOAD = 1.0  # offered load above which the queue can grow without bound
QUEUE_GROWTH = 0.05  # ... and does: TTFT growth over the trace, as a fraction of its span
_ZERO_TOKEN = np.zeros(1, dtype="<i4")  # broadcast to a prompt's length by ``lengths_only``


@dataclass(frozen=True)
class Distribution:
    """Mean and nearest-rank percentiles of a latency, in seconds (0.0 when empty)."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """The distribution of ``values`` (NaNs left out)."""
        xs = [v for v in values if not math.isnan(v)]
        if not xs:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(
            sum(xs) / len(xs), nearest_rank(xs, 50), nearest_rank(xs, 90), nearest_rank(xs, 99)
        )

    def report_dict(self, name: str) -> dict[str, float]:
        return {
            f"{name}_mean_s": self.mean,
            f"{name}_p50_s": self.p50,
            f"{name}_p90_s": self.p90,
            f"{name}_p99_s": self.p99,
        }


@dataclass(frozen=True)
class BenchmarkFigures:
    """One simulation (with or without the cache) summarized like a serving benchmark."""

    completed: int
    duration_s: float  # first arrival to last finish
    busy_s: float  # GPU time in steps
    input_tokens: int
    output_tokens: int
    ttft: Distribution
    tpot: Distribution
    e2e: Distribution

    @property
    def request_throughput(self) -> float:
        """Completed requests per second of the duration."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_token_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        """Prompt plus output tokens per second."""
        total = self.input_tokens + self.output_tokens
        return total / self.duration_s if self.duration_s > 0 else 0.0

    def report_dict(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "duration_s": self.duration_s,
            "busy_s": self.busy_s,
            "request_throughput_rps": self.request_throughput,
            "output_token_throughput_tps": self.output_token_throughput,
            "total_token_throughput_tps": self.total_token_throughput,
            **self.ttft.report_dict("ttft"),
            **self.tpot.report_dict("tpot"),
            **self.e2e.report_dict("e2e"),
        }


def benchmark_figures(
    arrival: Sequence[float],
    ttft: Sequence[float],
    finish: Sequence[float],
    prompt_len: Sequence[int],
    output_len: Sequence[int],
    busy_s: float,
    samples: Sequence[int] | None = None,
) -> BenchmarkFigures:
    """Figures over the requests that finished (``finish`` not NaN). ``output_len``: tokens
    generated over all of a request's samples; ``samples``: how many (1 each when None)."""
    done = [i for i, f in enumerate(finish) if not math.isnan(f)]
    start = min(arrival, default=0.0)
    end = max((finish[i] for i in done), default=start)
    e2e = [finish[i] - arrival[i] for i in done]
    per_sample = (
        output_len
        if samples is None
        else [t // n for t, n in zip(output_len, samples, strict=True)]
    )
    tpot = [
        (finish[i] - arrival[i] - ttft[i]) / (per_sample[i] - 1) for i in done if per_sample[i] > 1
    ]
    return BenchmarkFigures(
        completed=len(done),
        duration_s=end - start,
        busy_s=busy_s,
        input_tokens=sum(prompt_len[i] for i in done),
        output_tokens=sum(output_len[i] for i in done),
        ttft=Distribution.of([ttft[i] for i in done]),
        tpot=Distribution.of(tpot),
        e2e=Distribution.of(e2e),
    )


@dataclass(frozen=True)
class OfferedLoad:
    """How hard the arrivals push the GPUs: one, or a fleet's replicas."""

    arrival_span_s: float  # first to last arrival
    busy_s: float  # GPU time in steps, with the cache (summed over replicas)
    busy_nocache_s: float
    rate_scale: float  # arrivals were this many times as fast as the source's
    replicas: int = 1
    busiest_s: float | None = None  # a fleet: the busiest replica's time in steps
    ttft_growth_s: float | None = None  # mean TTFT of the last tenth of arrivals - the first's

    def _per_gpu(self, busy: float) -> float | None:
        span = self.arrival_span_s
        return busy / (self.replicas * span) if span > 0 else None

    @property
    def offered_load(self) -> float | None:
        """Busy time over arrival span (a fleet: per replica, on average); None when every
        request arrives at once."""
        return self._per_gpu(self.busy_s)

    @property
    def offered_load_nocache(self) -> float | None:
        return self._per_gpu(self.busy_nocache_s)

    @property
    def offered_load_busiest(self) -> float | None:
        """A fleet: the busiest replica's busy time over the arrival span."""
        if self.busiest_s is None or self.arrival_span_s <= 0:
            return None
        return self.busiest_s / self.arrival_span_s

    @property
    def binding_load(self) -> float | None:
        """The load that decides whether a queue grows: the busiest replica's in a fleet."""
        busiest = self.offered_load_busiest
        return busiest if busiest is not None else self.offered_load

    @property
    def overloaded(self) -> bool:
        """Busier than the arrivals allow, and the queue grew (see the module docstring)."""
        load = self.binding_load
        if load is None or load <= OVERLOAD:
            return False
        growth = self.ttft_growth_s
        return growth is None or growth > QUEUE_GROWTH * self.arrival_span_s

    @property
    def sustainable_rate_scale(self) -> float | None:
        """About the --rate-scale at which the (busiest) GPU's busy time equals the arrival
        span (an estimate: batching and routing change with the rate)."""
        load = self.binding_load
        return self.rate_scale / load if load else None

    def report_dict(self) -> dict[str, Any]:
        out = {
            "arrival_span_s": self.arrival_span_s,
            "busy_s": self.busy_s,
            "busy_nocache_s": self.busy_nocache_s,
            "offered_load": self.offered_load,
            "offered_load_nocache": self.offered_load_nocache,
            "overloaded": self.overloaded,
            "sustainable_rate_scale_estimate": self.sustainable_rate_scale,
            "ttft_growth_s": self.ttft_growth_s,
        }
        if self.replicas > 1:
            out["replicas"] = self.replicas
            out["busiest_replica_busy_s"] = self.busiest_s
            out["offered_load_busiest"] = self.offered_load_busiest
        return out


class RequestTimes:
    """Per request, by index in arrival order: what the benchmark figures and the load need
    (a fleet's replicas write into their fleet's)."""

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.ttft: list[float] = []  # NaN until the first token
        self.finish: list[float] = []  # when the last sample finished; NaN until then
        self.prompt_len: list[int] = []
        self.output_len: list[int] = []  # tokens generated over all samples
        self.samples: list[int] = []  # parallel samples

    def add(self, arrival_s: float, prompt_len: int, output_len: int, samples: int) -> None:
        self.arrival.append(arrival_s)
        self.ttft.append(math.nan)
        self.finish.append(math.nan)
        self.prompt_len.append(prompt_len)
        self.output_len.append(output_len * samples)
        self.samples.append(samples)

    def lengths_only(self) -> Iterator[Request]:
        """The requests added so far, again, as lengths alone: every token id 0 (a zero-stride
        array, no memory), the default namespace. What a pass that caches nothing reads of a
        request, so it need not read or generate the workload a second time."""
        for k, arrival in enumerate(self.arrival):
            n = self.samples[k]
            tokens = np.broadcast_to(_ZERO_TOKEN, (self.prompt_len[k],))
            yield Request(arrival, tokens, self.output_len[k] // n, DEFAULT_NAMESPACE, n)

    @property
    def span(self) -> float:
        """First to last arrival (0.0 without requests)."""
        return max(self.arrival) - min(self.arrival) if self.arrival else 0.0

    def figures(self, busy_s: float) -> BenchmarkFigures:
        return benchmark_figures(
            self.arrival,
            self.ttft,
            self.finish,
            self.prompt_len,
            self.output_len,
            busy_s,
            self.samples,
        )

    def ttft_growth(self) -> float | None:
        return ttft_growth(self.arrival, self.ttft)


def ttft_growth(arrival: Sequence[float], ttft: Sequence[float]) -> float | None:
    """Mean TTFT of the last tenth of the served requests (in arrival order) minus that of the
    first tenth; None with fewer than two served requests."""
    served = sorted((a, t) for a, t in zip(arrival, ttft, strict=True) if not math.isnan(t))
    if len(served) < 2:
        return None
    k = max(1, len(served) // 10)
    first = sum(t for _, t in served[:k]) / k
    last = sum(t for _, t in served[-k:]) / k
    return last - first
