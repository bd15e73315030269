"""Prometheus metrics of the service, in a registry of its own (one per app).

Counted as they happen: route decisions (policy, replica, rule), the cached fraction of routed
prompts, route latency, error responses, requests refused by access control and per-key limits,
requests their clients gave up on. Read at each scrape: the index's blocks and the in-flight load
per replica, whether each replica takes routes, the loads ended by the in-flight timeout, the
health of a shared (Redis) index, the counters of an ``IngestStats`` source when one is plugged
in, and the connections closed past the connection budget and the accepts that failed for lack
of descriptors (``ConnectionEvents``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.fleet.delivery_check import DeliveryCheck
from prefixcache.fleet.events.ingest import IngestStats
from prefixcache.fleet.router import RouteDecision, Router
from prefixcache.fleet.service.guards.connection_budget import CONNECTION_EVENTS, ConnectionEvents
from prefixcache.fleet.whatif.live_curves import LiveCurves

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_INGEST = (
    ("events", "KV event messages ingested"),
    ("blocks_stored", "blocks stored into the index"),
    ("blocks_removed", "blocks removed from the index"),
    ("sequence_gaps", "gaps in event sequence numbers"),
    ("errors", "ingest errors (index writes, undecodable messages)"),
    ("blocks_skipped", "blocks not indexed by rule (other attention groups, unnamed LoRA)"),
    ("blocks_recalled", "blocks stored before this router joined, mapped via the shared index"),
    ("blocks_unplaced", "blocks stored under a parent never seen, kept until placed"),
    ("blocks_placed_late", "unplaced blocks placed since (a later event, a lookup, a route)"),
    ("late_batches", "batches that came again or after newer ones, skipped"),
)


class _FleetCollector(Collector):
    """Index blocks and in-flight load per replica, and ingest counters, read at scrape time."""

    def __init__(self, router: Router, ingest: IngestStats | None) -> None:
        self._router = router
        self._ingest = ingest

    def collect(self) -> Iterator[Metric]:
        """The metric families, read now."""
        blocks = GaugeMetricFamily(
            "prefixcache_index_blocks", "Blocks the index holds per replica", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "prefixcache_replica_in_flight", "Routed requests not yet released", labels=["replica"]
        )
        tokens = GaugeMetricFamily(
            "prefixcache_replica_in_flight_tokens",
            "Prompt tokens to compute (not cached when routed) of routed requests not yet released",
            labels=["replica"],
        )
        index = self._router.index
        loads = self._router.loads()
        held = index.num_blocks_many([load.name for load in loads])
        for load in loads:
            blocks.add_metric([load.name], held[load.name])
            in_flight.add_metric([load.name], load.in_flight)
            tokens.add_metric([load.name], load.in_flight_tokens)
        yield blocks
        yield in_flight
        yield tokens
        up = GaugeMetricFamily(
            "prefixcache_replica_up", "1 while the replica takes routes", labels=["replica"]
        )
        marked = CounterMetricFamily(
            "prefixcache_replica_marked_down",
            "Times the replica was taken out of routing (failed requests or health probes)",
            labels=["replica"],
        )
        for health in self._router.health():
            up.add_metric([health.name], int(health.up))
            marked.add_metric([health.name], health.marked_down)
        yield up
        yield marked
        yield CounterMetricFamily(
            "prefixcache_route_expired",
            "Routed requests whose load ended by the in-flight timeout, never released",
            value=self._router.expired(),
        )
        stats = getattr(index, "stats", None)  # a shared (Redis) index reports its health
        if callable(stats):
            health = stats()
            yield CounterMetricFamily(
                "prefixcache_index_errors",
                "Failed calls to the shared index (answered from the local view meanwhile)",
                value=health.errors,
            )
            yield CounterMetricFamily(
                "prefixcache_index_resyncs",
                "Times the shared index was brought back in sync after an outage (missed writes "
                "sent again, or the local view written back)",
                value=health.resyncs,
            )
            yield GaugeMetricFamily(
                "prefixcache_index_in_sync",
                "1 while the shared index has every write, 0 during an outage",
                value=int(health.in_sync),
            )
        if self._ingest is None:
            return
        yield from _tenant_families(self._ingest)
        counts = self._ingest.ingest_counts()
        for position, (field, text) in enumerate(_INGEST):
            family = CounterMetricFamily(
                f"prefixcache_ingest_{field}", f"Ingest: {text}", labels=["replica"]
            )
            for replica, values in sorted(counts.items()):
                family.add_metric([replica], values[position])
            yield family


def _tenant_families(ingest: IngestStats) -> Iterator[Metric]:
    """Per tenant (a key's tenant; bounded by the keys file) and replica: GPU blocks held and
    evictions by whose stores came with them, when the ingestion counts them."""
    read = getattr(ingest, "tenant_counts", None)
    if not callable(read):
        return
    blocks = GaugeMetricFamily(
        "prefixcache_tenant_gpu_blocks",
        "GPU blocks of the tenant's namespaces the replica holds (from its KV events)",
        labels=["replica", "tenant"],
    )
    evicted = CounterMetricFamily(
        "prefixcache_tenant_evicted_blocks",
        "The tenant's GPU blocks the replica evicted: in event batches that stored other "
        "tenants' blocks only (by=others), or its own too (by=own)",
        labels=["replica", "tenant", "by"],
    )
    for replica, tenants in read().items():
        for tenant, row in tenants.items():
            blocks.add_metric([replica, tenant], row.gpu_blocks)
            evicted.add_metric([replica, tenant, "own"], row.evicted_own)
            evicted.add_metric([replica, tenant, "others"], row.evicted_by_others)
    yield blocks
    yield evicted


class _DeliveryCollector(Collector):
    """Predicted against delivered, read at scrape time: each replica's verdict and window, and
    where reuse went per tenant (bounded by the keys file) and model (by the config)."""

    def __init__(self, delivery: DeliveryCheck, replicas: Callable[[], list[str]]) -> None:
        self._delivery = delivery
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        """The verdicts and the attribution sums, read now."""
        delivery = self._delivery
        degraded = GaugeMetricFamily(
            "prefixcache_replica_degraded",
            "1 while the replica's engine reports cached tokens off the route's predictions "
            "(the reason is in /v1/replicas and the log)",
            labels=["replica"],
        )
        window = GaugeMetricFamily(
            "prefixcache_replica_delivery_window",
            "Reported requests in the replica's window (kind=requests), those whose engine "
            "delivered over a block less than predicted (under) or more (over)",
            labels=["replica", "kind"],
        )
        for name in self._replicas():
            state = delivery.state(name)
            degraded.add_metric([name], int(state.degraded))
            window.add_metric([name, "requests"], state.requests)
            window.add_metric([name, "under"], state.under)
            window.add_metric([name, "over"], state.over)
        yield degraded
        yield window
        tokens = CounterMetricFamily(
            "prefixcache_attributed_tokens",
            "Prompt tokens of requests whose engine reported its cached tokens (kind=prompt), "
            "the best any replica held when routed (available), what the chosen replica held "
            "(captured) and what its engine served from cache (delivered)",
            labels=["tenant", "model", "kind"],
        )
        requests = CounterMetricFamily(
            "prefixcache_attributed_requests",
            "Requests whose engine reported its cached tokens",
            labels=["tenant", "model"],
        )
        for (tenant, model), a in sorted(delivery.attribution().items()):
            requests.add_metric([tenant, model], a.requests)
            for kind, value in (
                ("prompt", a.prompt_tokens),
                ("available", a.available_tokens),
                ("captured", a.captured_tokens),
                ("delivered", a.delivered_tokens),
            ):
                tokens.add_metric([tenant, model, kind], value)
        yield tokens
        yield requests
        yield CounterMetricFamily(
            "prefixcache_unreported_requests",
            "Answered one-prompt requests whose answer carried no cached-token figure (the "
            "engine's cache report is off, or a stream without its usage chunk)",
            value=delivery.unreported,
        )


class _WhatIfCollector(Collector):
    """The live what-if curves, read at scrape time: per replica (and ``fleet``, one cache of
    their total), the estimated token hit rate at each capacity factor."""

    def __init__(self, curves: LiveCurves) -> None:
        self._curves = curves

    def collect(self) -> Iterator[Metric]:
        """Every point of every curve, and the rates they sample at, read now."""
        gauges = self._curves.gauges()
        family = GaugeMetricFamily(
            "prefixcache_whatif_token_hit_rate",
            "Estimated token hit rate of the traffic routed to the replica (curve=fleet: all "
            "of it as one cache) with factor times its KV capacity (sampled, LRU)",
            labels=["curve", "factor"],
        )
        for curve, factor, rate in gauges.points:
            family.add_metric([curve, f"{factor:g}"], rate)
        yield family
        running = GaugeMetricFamily(
            "prefixcache_whatif_sampling_rate",
            "Share of blocks the curve samples now: whatif.rate until the memory bound "
            "(whatif.max_memory_mib) lowers it",
            labels=["curve"],
        )
        for curve, rate in gauges.rates:
            running.add_metric([curve], rate)
        yield running
        yield GaugeMetricFamily(
            "prefixcache_whatif_requested_sampling_rate",
            "Share of blocks the curves were asked to sample (whatif.rate)",
            value=gauges.requested_rate,
        )


class _ConnectionCollector(Collector):
    """What happened to connections below the app, read at scrape time."""

    def __init__(self, events: ConnectionEvents) -> None:
        self._events = events

    def collect(self) -> Iterator[Metric]:
        """The connection counters, read now."""
        yield CounterMetricFamily(
            "prefixcache_connections_closed_over_limit",
            "Connections closed unanswered because the service held its maximum "
            "(server.max_connections and the accept headroom)",
            value=self._events.closed_over_limit,
        )
        yield CounterMetricFamily(
            "prefixcache_connections_evicted",
            "Connections waiting on their client (a partial request, an idle keep-alive) closed "
            "to make room for a new one, from the address holding the most",
            value=self._events.evicted,
        )
        yield CounterMetricFamily(
            "prefixcache_accept_failures",
            "accept() calls that failed for lack of descriptors or memory (the service then "
            "stops accepting for a second)",
            value=self._events.accept_failures,
        )


class ServiceMetrics:
    """The service's metrics and the registry that exports them."""

    def __init__(self, router: Router, ingest: IngestStats | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "prefixcache_route_decisions",
            "Route decisions by policy, chosen replica and deciding rule",
            ["policy", "replica", "rule"],
            registry=self.registry,
        )
        self.cached_fraction = Histogram(
            "prefixcache_route_cached_fraction",
            "Fraction of each routed prompt cached on the chosen replica",
            buckets=_FRACTION_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "prefixcache_route_latency_seconds",
            "Time to score and route one prompt (tokens to decision)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "prefixcache_http_errors",
            "Error responses by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "prefixcache_rejected_requests",
            "Requests refused by access control and per-key or per-client limits, by reason "
            "(unauthenticated, forbidden, rate_limited, in_flight_limit, body_timeout, "
            "client_limit) and key name",
            ["reason", "key"],
            registry=self.registry,
        )
        self.aborted = Counter(
            "prefixcache_aborted_requests",
            "Requests whose client disconnected before its body arrived, by endpoint",
            ["endpoint"],
            registry=self.registry,
        )
        self.registry.register(_FleetCollector(router, ingest))
        self.registry.register(_ConnectionCollector(CONNECTION_EVENTS))

    def watch_delivery(self, delivery: DeliveryCheck, router: Router) -> None:
        """Export ``delivery``'s verdicts and attribution sums."""
        self.registry.register(
            _DeliveryCollector(delivery, lambda: [s.name for s in router.replicas()])
        )

    def watch_whatif(self, curves: LiveCurves) -> None:
        """Export the live what-if curves."""
        self.registry.register(_WhatIfCollector(curves))

    def observe_route(self, decision: RouteDecision, seconds: float) -> None:
        """Count one route decision."""
        self.decisions.labels(decision.policy, decision.replica, decision.rule).inc()
        n = decision.prompt_tokens
        self.cached_fraction.observe(decision.cached_tokens / n if n else 0.0)
        self.latency.observe(seconds)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
