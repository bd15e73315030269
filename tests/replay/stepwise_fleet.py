"""The step-by-step fleet replay that the event-driven loop replaced, kept verbatim (over
``stepwise_serving``) as the oracle of the equality tests.

Fleet replay: N simulated replicas, each its own cache, behind the fleet router.

Every replica is a serving simulation (``serving.Simulator``) over its own ``CacheManager`` of the
configured size: ``capacity_blocks`` is per replica. Requests are routed at arrival by the real
``Router`` over a ``MemoryFleetIndex``, and the index is fed as the service feeds it, in process:
each replica's manager events become wire events (``to_wire``), one ``KVEventBatch`` per replica
per simulated step (``encode_batch``), handed to ``KVEventSubscriber.ingest`` with the replica's
next sequence number. A request counts as load on its replica from its route until it finishes
(or is dropped), then the router releases it.

Replicas run on their own clocks; the replica with the earliest clock steps next, and every
replica has stepped up to a request's arrival time before the request is routed, so a route sees
every block stored or removed before it (up to one step of the replica that overshoots).

The ``routing`` miss cause: at admission, the leading full prompt blocks held by any other
replica (read from the index, which is exact for replicas between their steps) that this replica
did not hit and that the fleet had seen in the namespace (``accounting.Accountant.record``).

Every replica serves the workload's model with any LoRA adapter and any salt (tenant), as vLLM
engines do (adapters loaded at run time, ``cache_salt`` per request); blocks still never match
across namespaces. A workload of several models is refused.

The pooled line is one replica with N times the blocks and N times the compute: token budget,
running sequences, peak FLOPs and memory bandwidth all scaled by N. With every block in one cache
and no route to get wrong, its hit rate is what routing aims for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from stepwise_serving import LiveRequest, Simulator

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.events.publisher import to_wire
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.events.wire import KVEventBatch, WireEvent, encode_batch
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.replica_spec import ANY_ADAPTER, ReplicaSpec
from prefixcache.fleet.router import Router
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.stats import BlockCounts, CacheStats
from prefixcache.replay.progress import Progress
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.run_result import ServingStats
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.fleet.pooled_line import pooled_config
from prefixcache.replay.sim.serving_figures import BenchmarkFigures, OfferedLoad, RequestTimes
from prefixcache.replay.tiers.admission import Tiers, build_tiers
from prefixcache.replay.workload.request import Request
from prefixcache.run_format import nearest_rank, rate

# the passes of a fleet replay, in order: each completes every request once
FLEET_PASSES = ("fleet", "fleet without cache", "pooled cache")


class ReplicaStats(NamedTuple):
    """What one replica of a fleet replay served."""

    name: str
    requests: int  # routed to it
    prompt_tokens: int  # of the requests it admitted
    hit_tokens: int
    token_hit_rate: float
    busy_seconds: float  # simulated time spent in steps
    steps: int
    evicted_blocks: int
    ttft_p50_s: float
    ttft_p99_s: float


class PooledLine(NamedTuple):
    """One replica with N x the blocks and N x the compute, replaying the same requests."""

    capacity_blocks: int
    token_hit_rate: float
    block_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float


@dataclass
class FleetStats:
    """Per-replica figures, load imbalance and the pooled upper bound of a fleet replay."""

    policy: str
    replicas: list[ReplicaStats]
    rules: dict[str, int]  # routes per deciding rule of the policy
    pooled: PooledLine | None = None
    index_blocks: int = 0  # blocks the fleet index holds at the end

    @property
    def request_imbalance(self) -> float:
        """Max over mean of the requests routed to each replica (1.0: even)."""
        return _imbalance([r.requests for r in self.replicas])

    @property
    def load_imbalance(self) -> float:
        """Max over mean of the replicas' busy seconds (1.0: even)."""
        return _imbalance([r.busy_seconds for r in self.replicas])

    def report_dict(self) -> dict[str, Any]:
        """The ``fleet`` object of report.json."""
        return {
            "replicas": len(self.replicas),
            "routing": self.policy,
            "request_imbalance": self.request_imbalance,
            "load_imbalance": self.load_imbalance,
            "route_rules": dict(sorted(self.rules.items())),
            "index_blocks": self.index_blocks,
            "per_replica": [r._asdict() for r in self.replicas],
            "pooled": self.pooled._asdict() if self.pooled is not None else None,
        }


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def _percentile(values: list[float], q: int) -> float:
    served = [v for v in values if not math.isnan(v)]
    return nearest_rank(served, q) if served else 0.0


class _Replica(Simulator):
    """A serving simulation that publishes its manager's events and reports finished requests."""

    def __init__(
        self, fleet: FleetSimulator, name: str, mgr: CacheManager, cfg: ResolvedConfig
    ) -> None:
        super().__init__(mgr, cfg, fleet.acc)
        self.fleet, self.name = fleet, name
        self.times = fleet.times  # indexed by the fleet's request index
        self.pending: list[WireEvent] = []
        self.seq = 0
        self.live: dict[int, LiveRequest] = {}
        self.routed = self.prompt_tokens = self.hit_tokens = 0
        mgr.add_listener(lambda event: self.pending.append(to_wire(event)))

    @property
    def busy_now(self) -> bool:
        """Something is waiting or running."""
        return bool(self.running or self.waiting)

    def take(self, live: LiveRequest) -> None:
        """Queue a request routed here."""
        if not self.busy_now and self.clock < live.req.arrival_s:
            self.clock = live.req.arrival_s
        self.waiting.append(live)
        self.live[live.idx] = live
        self.routed += 1

    def step(self) -> None:
        """One step; then publish its events and release the requests that left."""
        acc = self.acc
        prompt, hit = 0, 0
        if acc is not None:
            prompt, hit = acc.totals.prompt_tokens, acc.totals.hit_tokens
        self._step()  # counts its time in self.busy
        if acc is not None:
            self.prompt_tokens += acc.totals.prompt_tokens - prompt
            self.hit_tokens += acc.totals.hit_tokens - hit
        self.publish()
        if len(self.running) + len(self.waiting) < len(self.live):
            here = {r.idx for r in self.running}
            here.update(r.idx for r in self.waiting)
            for idx in [i for i in self.live if i not in here]:
                del self.live[idx]
                self.fleet.finished(idx)

    def publish(self) -> None:
        """The step's events as one wire batch, through the subscriber into the index."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        payload = encode_batch(KVEventBatch(self.clock, events, 0))
        self.fleet.subscriber.ingest(self.name, self.seq, payload)
        self.seq += 1

    def _measure(self, final: bool = False) -> None:
        """The fleet measures usage over all replicas instead."""


_NO_BLOCK = bytes(16)  # a digest no block has: what the no-cache fleet routes by


class FleetSimulator:
    """N replicas behind a router; ``run`` replays requests through them."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        acc: Accountant | None,
        namespace: Namespace,
        *,
        caching: bool = True,
        on_finish: Callable[[int], None] | None = None,
    ) -> None:
        """Every replica serves ``namespace``'s model, with any adapter and salt. ``on_finish``
        is told how many requests each replica step completed (a progress bar)."""
        o = cfg.options
        self.model = namespace.model
        namespace = Namespace(namespace.model)
        self.cfg, self.acc = cfg, acc
        self.block_size = o.block_size
        self.times = RequestTimes()  # per request, by the fleet's request index
        self.index = MemoryFleetIndex()
        self.versions: dict[tuple[str, str], str] = {}  # adapter versions the requests name
        names = [f"replica-{k}" for k in range(o.replicas)]
        self.subscriber = KVEventSubscriber(
            self.index,
            [
                ReplicaEndpoint(
                    name, namespace=namespace, block_size=self.block_size, hash_algo=o.hash_algo
                )
                for name in names
            ],
        )
        self.router = Router(
            self.index,
            [
                ReplicaSpec(name, namespace, self.block_size, cfg.capacity_blocks, (ANY_ADAPTER,))
                for name in names
            ],
            o.routing_policy,
            hash_algo=o.hash_algo,
        )
        self.replicas = [
            _Replica(self, name, cfg.cache_manager(caching=caching), cfg) for name in names
        ]
        for k, rep in enumerate(self.replicas):
            rep.elsewhere = self._elsewhere_of(k)
            rep.on_finish = on_finish
        # host tiers per replica, one pool shared by all of them
        self.caching = caching
        self.tiers = build_tiers(cfg, [r.mgr for r in self.replicas]) if caching else None
        if self.tiers is not None:
            for rep, admitter in zip(self.replicas, self.tiers.admitters, strict=True):
                rep.tiers = admitter
        self.assignment: list[int] = []
        self.rules: dict[str, int] = {}
        self.steps = 0
        self.truncated = 0
        self._usage = [(0, 0, 0)] * len(self.replicas)

    def _elsewhere_of(self, k: int) -> Callable[[LiveRequest], int]:
        rep = self.replicas[k]
        hasher = rep.mgr.hasher
        name = rep.name

        def elsewhere(live: LiveRequest) -> int:
            digests = live.digests
            if digests is None:
                digests = hasher.hash_prompt(live.req.tokens, live.req.namespace)
            if not digests:
                return 0
            return max(
                (m.blocks for m in self.index.match(digests) if m.replica != name), default=0
            )

        return elsewhere

    def _name_version(self, model: str, adapter: str, version: str) -> None:
        """The first version a request names for an adapter is the one the fleet serves (the
        replicas serve any adapter, so none pins it; KV events carry no version)."""
        if (model, adapter) not in self.versions:
            self.versions[(model, adapter)] = version
            # the index files the adapter's blocks under it (no replica pins one)
            self.subscriber._events.versions = dict(self.versions)

    def run(self, requests: Iterable[Request]) -> None:
        """Route and serve every request, then run the fleet until all have finished."""
        hasher = self.replicas[0].mgr.hasher  # the router's algorithm and block size
        p = hasher.block_size
        for idx, req in enumerate(requests):
            if req.namespace.model != self.model:
                raise ConfigError(
                    f"a fleet replay serves one model; request {idx} is for "
                    f"{req.namespace.model or 'the default model'!r}, the fleet's is "
                    f"{self.model or 'the default model'!r}: replay each model on its own"
                )
            self._advance(req.arrival_s)
            ns = req.namespace
            if ns.adapter is not None and ns.adapter_version is not None:
                self._name_version(ns.model, ns.adapter, ns.adapter_version)
            if self.caching:  # hashed once: the route, the pool and the report read them
                digests: list[bytes] | None = hasher.hash_prompt(req.tokens, req.namespace)
                route_digests = digests
            else:  # the no-cache fleet's index stays empty: no digest matches, none is computed
                digests, route_digests = None, [_NO_BLOCK] * (len(req.tokens) // p)
            decision = self.router.route(req.namespace, req.tokens, str(idx), digests=route_digests)
            self.rules[decision.rule] = self.rules.get(decision.rule, 0) + 1
            k = int(decision.replica.rsplit("-", 1)[1])
            self.times.add(req.arrival_s, len(req.tokens), req.output_len, req.n)
            self.assignment.append(k)
            live = LiveRequest(idx, req)
            live.digests = digests
            self.replicas[k].take(live)
        self._advance(math.inf)
        self._measure(final=True)
        self.truncated = sum(r.truncated for r in self.replicas)

    def _advance(self, until: float) -> None:
        """Step the replica with the earliest clock while any busy one is before ``until``."""
        reps = self.replicas
        while True:
            best = None
            for rep in reps:
                if rep.busy_now and rep.clock < until and (best is None or rep.clock < best.clock):
                    best = rep
            if best is None:
                return
            best.step()
            self.steps += 1
            k = reps.index(best)
            logical, frag = best.usage()
            self._usage[k] = (best.mgr.block_counts().active, logical, frag)
            self._measure()

    def finished(self, idx: int) -> None:
        """A request left its replica: its load goes."""
        self.router.release(str(idx))

    def _measure(self, final: bool = False) -> None:
        acc = self.acc
        if acc is None:
            return
        physical = sum(u[0] for u in self._usage)
        acc.note_usage(physical, sum(u[1] for u in self._usage), sum(u[2] for u in self._usage))
        if acc.timeline is None or not (final or acc.timeline.due(self.steps)):
            return
        counts = [r.mgr.block_counts() for r in self.replicas]
        total = BlockCounts(
            sum(c.free for c in counts),
            sum(c.active for c in counts),
            sum(c.cached for c in counts),
        )
        evicted = sum(r.mgr.stats.evicted_blocks for r in self.replicas)
        # the fleet's now: the earliest clock of a busy replica (replicas step in that order, so
        # it never goes back); with all idle, when the last one finished
        busy = [r.clock for r in self.replicas if r.busy_now]
        acc.sample_timeline(self.steps, min(busy) if busy else self.clock, total, evicted, final)

    @property
    def busy(self) -> float:
        """GPU seconds in steps, summed over the replicas."""
        return sum(r.busy for r in self.replicas)

    def figures(self) -> BenchmarkFigures:
        """The fleet's throughput and latency, as a serving benchmark against it reports."""
        return self.times.figures(self.busy)

    @property
    def clock(self) -> float:
        """The latest replica clock: when the last request finished."""
        return max((r.clock for r in self.replicas), default=0.0)

    def replica_stats(self) -> list[ReplicaStats]:
        """Per-replica figures (TTFTs from the fleet's per-request list)."""
        ttfts: list[list[float]] = [[] for _ in self.replicas]
        for idx, k in enumerate(self.assignment):
            ttfts[k].append(self.times.ttft[idx])
        return [
            ReplicaStats(
                r.name,
                r.routed,
                r.prompt_tokens,
                r.hit_tokens,
                rate(r.hit_tokens, r.prompt_tokens),
                r.busy,
                r.steps,
                r.mgr.stats.evicted_blocks,
                _percentile(ttfts[k], 50),
                _percentile(ttfts[k], 99),
            )
            for k, r in enumerate(self.replicas)
        ]

    def cache_stats(self) -> CacheStats:
        """The managers' counters, summed."""
        total = CacheStats()
        names = [f.name for f in fields(CacheStats)]  # no __dict__ when compiled
        for r in self.replicas:
            for key in names:
                setattr(total, key, getattr(total, key) + getattr(r.mgr.stats, key))
        return total


def run_pooled(
    requests: Iterable[Request],
    cfg: ResolvedConfig,
    on_finish: Callable[[int], None] | None = None,
) -> PooledLine:
    """Replay ``requests`` through the pooled cache of ``pooled_config(cfg)``; ``on_finish`` is
    told how many requests each step completed."""
    pooled = pooled_config(cfg)
    mgr = pooled.cache_manager()
    acc = Accountant(pooled.options.block_size, mgr.hasher, track_isolation=False, record=False)
    sim = Simulator(mgr, pooled, acc)
    sim.on_finish = on_finish
    tiers = build_tiers(pooled, [mgr])
    sim.tiers = tiers.admitters[0] if tiers is not None else None
    sim.run(requests)
    tot = acc.totals
    return PooledLine(
        pooled.capacity_blocks,
        rate(tot.hit_tokens, tot.prompt_tokens),
        rate(tot.hit_blocks, tot.prompt_blocks),
        _percentile(sim.times.ttft, 50),
        _percentile(sim.times.ttft, 99),
    )


class FleetRun(NamedTuple):
    """What ``run_fleet`` hands back to the runner."""

    serving: ServingStats
    fleet: FleetStats
    stats: CacheStats
    tiers: Tiers | None = None
    managers: tuple[CacheManager, ...] = ()  # the replicas' caches, in replica order


def run_fleet(
    requests: Iterable[Request],
    reopen: Callable[[], Iterable[Request]],
    acc: Accountant,
    cfg: ResolvedConfig,
    progress: Progress | None = None,
    *,
    side_process: bool | None = None,  # the reference runs every pass here, one after another
) -> FleetRun:
    """Replay through the fleet, then a no-cache fleet (same routing) for the no-cache TTFTs and
    the pooled cache for the upper bound. ``reopen()`` yields the requests again. Every replica
    serves the model of the first request, with any adapter and salt (tenants). ``progress``
    counts the requests completed in each of the ``FLEET_PASSES`` passes, named as it goes."""
    it = iter(requests)
    first = next(it, None)
    namespace = first.namespace if first is not None else Namespace("default")

    def chain() -> Iterable[Request]:
        if first is not None:
            yield first
        yield from it

    on_finish = progress.update if progress is not None else None
    stage = progress.stage if progress is not None else lambda name: None
    stage(FLEET_PASSES[0])
    sim = FleetSimulator(cfg, acc, namespace, on_finish=on_finish)
    sim.run(chain())
    stage(FLEET_PASSES[1])
    plain = FleetSimulator(cfg, None, namespace, caching=False, on_finish=on_finish)
    plain.run(reopen())
    stage(FLEET_PASSES[2])
    pooled = run_pooled(reopen(), cfg, on_finish)
    times = sim.times
    o = cfg.options
    serving = ServingStats(
        times.ttft,
        plain.times.ttft,
        sum(r.preemptions for r in sim.replicas),
        sim.steps,
        sim.clock - min(times.arrival, default=sim.clock),  # first arrival to last finish
        sim.truncated,
        with_cache=sim.figures(),
        without_cache=plain.figures(),
        load=OfferedLoad(
            times.span,
            sim.busy,
            plain.busy,
            o.rate_scale / o.time_scale,
            len(sim.replicas),
            max(r.busy for r in sim.replicas),
            times.ttft_growth(),
        ),
        assumptions=sim.replicas[0].roof.assumptions(),
    )
    fleet = FleetStats(
        cfg.options.routing_policy,
        sim.replica_stats(),
        sim.rules,
        pooled,
        sum(sim.index.num_blocks(r.name) for r in sim.replicas),
    )
    managers = tuple(r.mgr for r in sim.replicas)
    return FleetRun(serving, fleet, sim.cache_stats(), sim.tiers, managers)
