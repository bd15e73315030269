"""Fleet replay: N simulated replicas, each its own cache, behind the fleet router.

Every replica is a serving simulation (``serving.Simulator``) over its own ``CacheManager`` of the
configured size: ``capacity_blocks`` is per replica. Requests are routed at arrival by the real
``Router`` over the fleet index the service would keep from the replicas' KV events: read from the
replicas' radix trees while it would hold just what they hold (``replica_trees``), else a
``MemoryFleetIndex`` each replica's manager events reach as they happen, applied as the service's
KV-event path would apply them (``index_feed``). A request counts as
load on its replica from its route until it finishes (or is dropped), then the router releases
it.

Replicas run on their own clocks; the replica with the earliest clock steps next, and every
replica has stepped up to a request's arrival time before the request is routed, so a route sees
every block stored or removed before it (up to one step of the replica that overshoots).

The ``routing`` miss cause: at admission, the leading full prompt blocks held by any other
replica (read from the index, which is exact for replicas between their steps) that this replica
did not hit and that the fleet had seen in the namespace (``accounting.Accountant.record``).

Every replica serves the workload's model with any LoRA adapter and any salt (tenant), as vLLM
engines do (adapters loaded at run time, ``cache_salt`` per request); blocks still never match
across namespaces. A workload of several models is refused.

The pooled line (``pooled_line``) is one replica with N times the blocks and N times the
compute: its hit rate is what routing aims for. It and the no-cache fleet read nothing of the
fleet pass: where a second core is usable they run beside it in a second process
(``side_process``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.replica_spec import ANY_ADAPTER, ReplicaSpec
from prefixcache.fleet.router import Router
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.stats import CacheStats
from prefixcache.replay.progress import Progress
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.run_result import ServingStats
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.fleet.index_feed import ReplicaIndexFeed
from prefixcache.replay.sim.fleet.pooled_line import PooledLine, run_pooled, served_percentile
from prefixcache.replay.sim.fleet.replica_trees import ReplicaTrees
from prefixcache.replay.sim.serving import LiveRequest, Simulator, advance_replicas
from prefixcache.replay.sim.serving_figures import BenchmarkFigures, OfferedLoad, RequestTimes
from prefixcache.replay.sim.side_process import SideRun, side_process_available, skip_first
from prefixcache.replay.sim.step_tally import StepTally
from prefixcache.replay.sim.uncached_blocks import UncachedBlocks
from prefixcache.replay.tiers.admission import Tiers, build_tiers
from prefixcache.replay.workload.request import Request
from prefixcache.run_format import rate

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


class _Replica:
    """One replica: a serving simulation whose manager's events reach the fleet's index, and
    whose finished requests the router releases before its next route."""

    def __init__(
        self,
        fleet: FleetSimulator,
        name: str,
        mgr: CacheManager | UncachedBlocks,
        cfg: ResolvedConfig,
    ) -> None:
        self.fleet, self.name = fleet, name
        sim = self.sim = Simulator(mgr, cfg, fleet.acc)
        sim.times = fleet.times  # indexed by the fleet's request index
        self.live: dict[int, LiveRequest] = {}
        self.routed = 0
        self.feed: ReplicaIndexFeed | None = None  # once the fleet index is fed (replica_trees)

    def start_feed(self, held: Iterable[bytes] = ()) -> None:
        """From now on the replica's events reach the fleet's fed index (``held``: the blocks it
        holds now, filed there already), read without token ids until a chain may be filed
        under another digest (``read_token_ids``)."""
        fleet = self.fleet
        self.feed = ReplicaIndexFeed(
            fleet.index.fed, self.name, self.mgr.hasher, fleet.versions, held=held, token_ids=False
        )
        self.mgr.add_listener(self.feed, token_ids=False)

    @property
    def mgr(self) -> CacheManager:
        """The replica's cache manager (the no-cache fleet's replicas have none)."""
        return self.sim.mgr

    def read_token_ids(self) -> None:
        """From now on the feed's events carry token ids (it may hash a chain again)."""
        if self.feed is not None and not self.feed.token_ids:
            self.mgr.remove_listener(self.feed)
            self.feed.token_ids = True
            self.mgr.add_listener(self.feed)

    def take(self, live: LiveRequest) -> None:
        """Queue a request routed here."""
        self.sim.take(live)
        self.live[live.idx] = live
        self.routed += 1

    def release_left(self) -> None:
        """Release the requests that left since the last call (the router reads their load at
        the next route only, so releasing them then is releasing them as they leave)."""
        sim = self.sim
        if len(sim.running) + len(sim.waiting) < len(self.live):
            here = {r.idx for r in sim.running}
            here.update(r.idx for r in sim.waiting)
            for idx in [i for i in self.live if i not in here]:
                del self.live[idx]
                self.fleet.finished(idx)


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
        self.index = ReplicaTrees({}, MemoryFleetIndex())  # the replicas' trees join below
        self.versions: dict[tuple[str, str], str] = {}  # adapter versions the requests name
        names = [f"replica-{k}" for k in range(o.replicas)]
        self.router = Router(
            self.index,
            [
                ReplicaSpec(name, namespace, self.block_size, cfg.capacity_blocks, (ANY_ADAPTER,))
                for name in names
            ],
            o.routing_policy,
            hash_algo=o.hash_algo,
        )
        self.caching = caching
        self.replicas = [_Replica(self, name, self._cache(cfg), cfg) for name in names]
        for k, rep in enumerate(self.replicas):
            if caching:
                rep.sim.elsewhere = self._elsewhere_of(k)
            rep.sim.on_finish = on_finish
        # host tiers per replica, one pool shared by all of them
        self.tiers = build_tiers(cfg, [r.mgr for r in self.replicas]) if caching else None
        if self.tiers is not None:
            for rep, admitter in zip(self.replicas, self.tiers.admitters, strict=True):
                rep.sim.tiers = admitter
        if caching:
            self.index.caches = {r.name: r.mgr.internals for r in self.replicas}
            # the trees answer while each replica's GPU blocks are all the index would hold
            lean = cfg.capacity_blocks <= self.index.max_blocks_per_replica
            if self.tiers is not None or not lean:
                self.feed_index()
        self.assignment: list[int] = []
        self.rules: dict[str, int] = {}
        self.truncated = 0
        # usage and timeline over the replicas together (none without an accountant)
        self.sims = [r.sim for r in self.replicas]
        self.tally = StepTally(acc, self.sims, fleet=True) if acc is not None else None

    def _cache(self, cfg: ResolvedConfig) -> CacheManager | UncachedBlocks:
        """A replica's cache: its manager, or block counts alone for the no-cache fleet."""
        if self.caching:
            return cfg.cache_manager()
        return UncachedBlocks(cfg.capacity_blocks, cfg.options.block_size)

    @property
    def steps(self) -> int:
        """Steps taken, every replica's together (with an accountant, those that found nothing
        to run too)."""
        if self.tally is not None:
            return self.tally.steps
        return sum(r.sim.steps for r in self.replicas)

    def feed_index(self) -> None:
        """The fed index answers from now on: it takes what the trees hold, then every event."""
        held = self.index.file_in_index()
        for rep in self.replicas:
            rep.start_feed(held.get(rep.name, ()))

    def _elsewhere_of(self, k: int) -> Callable[[LiveRequest], int]:
        rep = self.replicas[k]
        hasher = rep.mgr.hasher
        name = rep.name
        longest = self.index.longest_elsewhere  # the most any other replica holds

        def elsewhere(live: LiveRequest) -> int:
            digests = live.digests
            if digests is None:
                digests = hasher.hash_prompt(live.req.tokens, live.req.namespace)
            if not digests:
                return 0
            return longest(digests, name, live.req.namespace)

        return elsewhere

    def _name_version(self, model: str, adapter: str, version: str) -> None:
        """The first version a request names for an adapter is the one the fleet serves (the
        replicas serve any adapter, so none pins it; KV events carry no version)."""
        if self.versions.setdefault((model, adapter), version) != version:
            if self.caching and not self.index.filed:  # no tree holds its chains' digests
                self.feed_index()
            for rep in self.replicas:  # its chains are filed under the pinned version's digests
                rep.read_token_ids()

    def run(self, requests: Iterable[Request]) -> None:
        """Route and serve every request, then run the fleet until all have finished."""
        hasher = self.replicas[0].mgr.hasher if self.caching else None  # the router's
        p = self.block_size
        for idx, req in enumerate(requests):
            if req.namespace.model != self.model:
                raise ConfigError(
                    f"a fleet replay serves one model; request {idx} is for "
                    f"{req.namespace.model or 'the default model'!r}, the fleet's is "
                    f"{self.model or 'the default model'!r}: replay each model on its own"
                )
            self._advance(req.arrival_s)
            for rep in self.replicas:
                rep.release_left()
            ns = req.namespace
            if ns.adapter is not None and ns.adapter_version is not None:
                self._name_version(ns.model, ns.adapter, ns.adapter_version)
            if hasher is not None:  # hashed once: the route, the pool and the report read them
                digests: list[bytes] | None = hasher.hash_prompt(req.tokens, req.namespace)
                route_digests = digests
            else:  # the no-cache fleet's index stays empty: no digest matches, none is computed
                digests, route_digests = None, [_NO_BLOCK] * (len(req.tokens) // p)
            self.index.namespace = req.namespace  # the trees' root its digests are under
            decision = self.router.route(req.namespace, req.tokens, str(idx), digests=route_digests)
            self.rules[decision.rule] = self.rules.get(decision.rule, 0) + 1
            k = int(decision.replica.rsplit("-", 1)[1])
            self.times.add(req.arrival_s, len(req.tokens), req.output_len, req.n)
            self.assignment.append(k)
            live = LiveRequest(idx, req)
            live.digests = digests
            self.replicas[k].take(live)
        self._advance(math.inf)
        for rep in self.replicas:
            rep.release_left()
        if self.tally is not None:
            self.tally.finish()
        self.truncated = sum(r.sim.truncated for r in self.replicas)

    def _advance(self, until: float) -> None:
        """Step the replicas, earliest clock first, while any busy one is before ``until``."""
        advance_replicas(self.sims, until)

    def finished(self, idx: int) -> None:
        """A request left its replica: its load goes."""
        self.router.release(str(idx))

    @property
    def busy(self) -> float:
        """GPU seconds in steps, summed over the replicas."""
        return sum(r.sim.busy for r in self.replicas)

    def figures(self) -> BenchmarkFigures:
        """The fleet's throughput and latency, as a serving benchmark against it reports."""
        return self.times.figures(self.busy)

    @property
    def clock(self) -> float:
        """The latest replica clock: when the last request finished."""
        return max((r.sim.clock for r in self.replicas), default=0.0)

    def replica_stats(self) -> list[ReplicaStats]:
        """Per-replica figures (TTFTs from the fleet's per-request list)."""
        ttfts: list[list[float]] = [[] for _ in self.replicas]
        for idx, k in enumerate(self.assignment):
            ttfts[k].append(self.times.ttft[idx])
        return [
            ReplicaStats(
                r.name,
                r.routed,
                r.sim.prompt_tokens,
                r.sim.hit_tokens,
                rate(r.sim.hit_tokens, r.sim.prompt_tokens),
                r.sim.busy,
                r.sim.steps,
                r.mgr.stats.evicted_blocks,
                served_percentile(ttfts[k], 50),
                served_percentile(ttfts[k], 99),
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


class FleetRun(NamedTuple):
    """What ``run_fleet`` hands back to the runner."""

    serving: ServingStats
    fleet: FleetStats
    stats: CacheStats
    tiers: Tiers | None = None
    managers: tuple[CacheManager, ...] = ()  # the replicas' caches, in replica order


class _SideLines(NamedTuple):
    """What the fleet's figures need of its no-cache and pooled passes."""

    ttft: list[float]  # the no-cache fleet's, by request index
    figures: BenchmarkFigures  # the no-cache fleet's
    busy: float  # the no-cache fleet's GPU seconds
    pooled: PooledLine


def _side_passes(
    reopen: Callable[[], Iterable[Request]],
    cfg: ResolvedConfig,
    namespace: Namespace,
    on_finish: Callable[[int], None] | None,
    stage: Callable[[int], None],
) -> _SideLines:
    """The no-cache fleet and the pooled cache, each over ``reopen()``: they read nothing of the
    fleet pass. ``stage(k)``: pass ``k`` of ``FLEET_PASSES`` begins."""
    stage(1)
    plain = FleetSimulator(cfg, None, namespace, caching=False, on_finish=on_finish)
    plain.run(reopen())
    stage(2)
    pooled = run_pooled(reopen(), cfg, on_finish)
    return _SideLines(plain.times.ttft, plain.figures(), plain.busy, pooled)


def run_fleet(
    requests: Iterable[Request],
    reopen: Callable[[], Iterable[Request]],
    acc: Accountant,
    cfg: ResolvedConfig,
    progress: Progress | None = None,
    *,
    side_process: bool | None = None,
) -> FleetRun:
    """Replay through the fleet, then a no-cache fleet (same routing) for the no-cache TTFTs and
    the pooled cache for the upper bound. ``reopen()`` yields the requests again. Every replica
    serves the model of the first request, with any adapter and salt (tenants). ``progress``
    counts the requests completed in each of the ``FLEET_PASSES`` passes, named as it goes.

    ``side_process``: run the no-cache and pooled passes in a second process while the fleet
    pass runs here (``side_process.SideRun``; same figures, less wall time); None: where a
    second core is usable (a point of a parallel sweep passes False: its cores are taken)."""
    it = iter(requests)
    first = next(it, None)
    namespace = first.namespace if first is not None else Namespace("default")

    def chain() -> Iterable[Request]:
        if first is not None:
            yield first
        yield from it

    update = progress.update if progress is not None else None
    name = progress.stage if progress is not None else lambda name: None
    if side_process is None:
        side_process = side_process_available()
    side: SideRun[_SideLines] | None = None
    if side_process and first is not None:
        try:
            side = SideRun(
                lambda count, stage: _side_passes(reopen, cfg, namespace, count, stage),
                first_stage=1,
            )
        except OSError:  # no process to be had (memory, process limits): all passes here
            side = None
    lines: _SideLines | None = None
    try:
        sim = FleetSimulator(cfg, acc, namespace, on_finish=_with_side(update, name, side))
        sim.run(chain())
        if side is not None:
            tick = _with_side(update, name, side, fleet_done=True)
            lines = side.result((lambda: tick(0)) if tick is not None else None)
            if tick is not None:
                tick(0)  # the last of the side's counts
    finally:
        if side is not None:
            side.stop()
    if lines is None:  # no second process, or it ended without its figures: run them here
        counted = side.taken if side is not None else 0  # on the bar already
        lines = _side_passes(
            reopen, cfg, namespace, skip_first(update, counted), lambda k: name(FLEET_PASSES[k])
        )
    times = sim.times
    o = cfg.options
    serving = ServingStats(
        times.ttft,
        lines.ttft,
        sum(r.sim.preemptions for r in sim.replicas),
        sim.steps,
        sim.clock - min(times.arrival, default=sim.clock),  # first arrival to last finish
        sim.truncated,
        with_cache=sim.figures(),
        without_cache=lines.figures,
        load=OfferedLoad(
            times.span,
            sim.busy,
            lines.busy,
            o.rate_scale / o.time_scale,
            len(sim.replicas),
            max(r.sim.busy for r in sim.replicas),
            times.ttft_growth(),
        ),
        assumptions=sim.replicas[0].sim.roof.assumptions(),
    )
    fleet = FleetStats(
        cfg.options.routing_policy,
        sim.replica_stats(),
        sim.rules,
        lines.pooled,
        sum(sim.index.num_blocks(r.name) for r in sim.replicas),
    )
    managers = tuple(r.mgr for r in sim.replicas)
    return FleetRun(serving, fleet, sim.cache_stats(), sim.tiers, managers)


def _with_side(
    update: Callable[[int], None] | None,
    name: Callable[[str], None],
    side: SideRun[_SideLines] | None,
    *,
    fleet_done: bool = False,
) -> Callable[[int], None] | None:
    """The fleet pass's ``on_finish``: counts ``n`` on the bar, with what the side process
    completed meanwhile, and names the passes running (``fleet_done``: the side's alone)."""
    shown = -1

    def label(k: int) -> None:  # k < 0: the side's passes are done
        nonlocal shown
        shown = k
        if k < 0 or fleet_done:
            name(FLEET_PASSES[0] if k < 0 else FLEET_PASSES[k])
        else:
            name(f"{FLEET_PASSES[0]} + {FLEET_PASSES[k]}")

    if side is None:
        name(FLEET_PASSES[0])
        return update
    label(side.stage)
    if update is None:
        return None

    def on_finish(n: int) -> None:
        if side.stage != shown:
            label(side.stage)
        n += side.counted()
        if n:
            update(n)

    return on_finish
