"""Run replays: open the source, build the cache manager, drive it, collect the result.

A sweep runs several cache configurations over one workload, in parallel processes or Ray tasks
(``sweep_executors``). The first configuration is the primary run (full per-request rows); the
others report one line each. Workers re-open the source themselves, so nothing large crosses
process boundaries. This process replays the primary point, then takes the points no worker has
started yet.

Long replays show a progress bar on stderr when it is a terminal: tqdm when installed, otherwise
a single self-rewriting line; either way redrawn about twice a second (``progress``), so it costs
nothing per request. A serving replay's bar counts completed requests over every pass of the run
(with and without cache; a fleet's pooled cache too), so it reaches its total when the run ends.
A sweep shows one bar for all its points, wherever they run.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from prefixcache.errors import MissingDependencyError
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.replay.progress import (
    LINE_TRACE_KINDS,
    Progress,
    SweepProgress,
    count_lines,
    counted,
)
from prefixcache.replay.progress import enabled as progress_enabled
from prefixcache.replay.run_config import ReplayConfig, ResolvedConfig
from prefixcache.replay.run_result import ReplayResult
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.sequential import run_sequential
from prefixcache.replay.sweep_executors import (
    PointProgress,
    check_executor,
    count_points_into,
    open_executor,
    point_done,
    point_progress,
    shared_counter,
)
from prefixcache.replay.tenant_report import tenants_report, with_comparison
from prefixcache.replay.tiers.admission import Tiers, build_tiers
from prefixcache.replay.tiers.summary import tiers_report
from prefixcache.replay.workload.arrivals import ScaledArrivals
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.sources import Source, open_source

T = TypeVar("T")


def replay_source(
    source: Source, config: ReplayConfig, *, progress: bool | None = False
) -> ReplayResult:
    """Replay ``source`` through a fresh CacheManager. ``progress``: None shows a bar when
    stderr is a terminal."""
    return _replay(source, config.resolve(), progress)


def _replay(
    source: Source,
    resolved: ResolvedConfig,
    progress: bool | None,
    shared: PointProgress | None = None,
    *,
    alone: bool = True,
) -> ReplayResult:
    """``shared``: a sweep's bar to count into (left open) instead of a bar of its own.
    ``alone``: not a point of a sweep (only then may a serving replay take a second core)."""
    config = resolved.options
    mgr = resolved.cache_manager()
    acc = Accountant(
        config.block_size,
        mgr.hasher,
        track_isolation=source.multi_namespace,
        record=config.record,
        upper_bound=config.upper_bound,
    )
    arrivals = ScaledArrivals(source, config.arrival_factor)
    bar: PointProgress | None = shared
    if shared is None:
        bar = _serving_progress(source, resolved, progress)
    requests: Iterable[Request] = arrivals
    if config.mode != "serving" and shared is not None:
        requests = _counted_into(arrivals, shared)
    elif bar is None:
        requests = with_progress(
            arrivals, _total(source, progress), f"replay {source.name}", progress
        )
    start = time.perf_counter()
    serving = None
    tiers: Tiers | None = None
    extra: dict[str, Any] = {}
    stats = mgr.stats
    managers: tuple[CacheManager, ...] = (mgr,)
    with _no_automatic_gc():
        if config.is_fleet:
            run_fleet = _fleet_replay()
            finished = False
            try:
                fleet = run_fleet(
                    requests,
                    lambda: iter(arrivals),
                    acc,
                    resolved,
                    bar,
                    side_process=None if alone else False,
                )
                finished = True
            finally:
                if bar is not None and shared is None:
                    bar.close(finished)
            serving, stats, tiers = fleet.serving, fleet.stats, fleet.tiers
            managers = fleet.managers
            truncated = serving.truncated
            extra["fleet"] = fleet.fleet.report_dict()
            tot = acc.totals
            # the service's attribution, from the replay's own view: what another replica held
            # beyond the chosen one's is the routing miss; the engine delivers what it holds
            extra["fleet"]["attribution"] = {
                "prompt_tokens": tot.prompt_tokens,
                "available_tokens": tot.hit_tokens + tot.routing,
                "captured_tokens": tot.hit_tokens,
                "delivered_tokens": tot.hit_tokens,
            }
        elif config.mode == "sequential":
            tiers = build_tiers(resolved, [mgr])
            truncated = run_sequential(requests, mgr, acc, tiers.admitters[0] if tiers else None)
        else:
            from prefixcache.replay.sim.serving_passes import run_serving

            tiers = build_tiers(resolved, [mgr])
            admitter = tiers.admitters[0] if tiers else None
            finished = False
            try:
                serving = run_serving(
                    requests,
                    mgr,
                    acc,
                    resolved,
                    bar.update if bar else None,
                    admitter,
                    reopen=(lambda: iter(arrivals)) if alone else None,
                )
                finished = True
            finally:
                if bar is not None and shared is None:
                    bar.close(finished)
            truncated = serving.truncated
    elapsed = time.perf_counter() - start
    if tiers is not None:
        extra["tiers"] = tiers_report(tiers, acc.totals, stats)
    if config.shares is not None:
        extra["tenants"] = _tenants(source, resolved, acc, managers)
    info = {
        "path": source.path,
        "kind": source.kind,
        "sha256": source.sha256(),
        "name": source.name,
    }
    return ReplayResult(
        info, resolved, source.seed, acc, stats, elapsed, serving, truncated, extra=extra
    )


def _tenants(
    source: Source, resolved: ResolvedConfig, acc: Accountant, managers: Sequence[CacheManager]
) -> dict[str, Any]:
    """The per-tenant section; with shares, next to the same replay without them."""
    report = tenants_report(acc, managers, resolved.tenant_shares())
    if resolved.options.shares:  # shares given: replay once more, every tenant counted
        twin = replace(resolved, options=resolved.options.with_(shares=()))
        without = _replay(source, twin, False)
        report = with_comparison(report, without.extra["tenants"])
    return report


def _fleet_replay() -> Callable[..., Any]:
    """The fleet simulation, which runs the service's own router (msgspec's library, from the
    service extra)."""
    try:
        from prefixcache.replay.sim.fleet.simulator import run_fleet
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "msgspec":
            raise
        raise MissingDependencyError(
            f"a fleet replay (--replicas, --routing) runs the service's router, which needs "
            f"{exc.name}: pip install 'prefixcache[service]'"
        ) from None
    return run_fleet


@contextmanager
def _no_automatic_gc() -> Iterator[None]:
    """Replay frees its objects by reference counting; the cyclic collector would only rescan
    the cache's growing structures, costing about a tenth of the replay time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def replay_requests(requests: Sequence[Request], config: ReplayConfig) -> ReplayResult:
    """Replay requests built in Python."""
    return replay_source(Source.from_requests(requests), config)


def replay_path(
    path: str | Path, config: ReplayConfig | None = None, *, progress: bool | None = False
) -> ReplayResult:
    """Replay a scenario file or trace: ``replay_path("scenarios/rag.yaml",
    ReplayConfig(capacity_blocks=4096)).to_report_dict()``."""
    config = config or ReplayConfig()
    resolved = config.resolve()
    return _replay(open_source(path, config), resolved, progress)


# ---- sweeps -----------------------------------------------------------------------------------


def _summary_row(path: str, resolved: ResolvedConfig) -> dict[str, Any]:
    """A sweep point replayed in a worker process (or in this one, once its own point is
    done), which opens the source itself and counts into the sweep's bar, if any."""
    source = open_source(path, resolved.options)
    try:
        return _replay(source, resolved, False, point_progress(), alone=False).summary_row()
    finally:
        point_done()


def replay_sweep(
    path: str | Path,
    configs: list[ReplayConfig],
    *,
    jobs: int | None = None,
    progress: bool | None = False,
    executor: str = "local",
    ray_address: str | None = None,
) -> ReplayResult:
    """Replay ``configs[0]`` in full and every config's summary; ``result.sweep`` lists them.
    ``executor``: where the other points run, ``local`` processes (``jobs`` of them, this one
    included) or ``ray`` tasks (on the cluster at ``ray_address``)."""
    if not configs:
        raise ValueError("replay_sweep needs at least one configuration")
    check_executor(executor, ray_address)
    # resolve and open everything first: a bad configuration fails before any process starts
    points = [configs[0], *(c.with_(record=False) for c in configs[1:])]
    resolved = [c.resolve() for c in points]
    sources = [open_source(path, c) for c in points]
    jobs = max(1, jobs or min(len(configs), os.cpu_count() or 1))
    if len(points) == 1:
        return _replay(sources[0], resolved[0], progress)
    rest = resolved[1:]
    rows: list[dict[str, Any]] = [{} for _ in rest]
    sizes = [_point_size(source, r, progress) for source, r in zip(sources, resolved, strict=True)]
    bar = _sweep_progress(path, sizes, progress)
    counter = bar.shared if bar is not None else None
    before = count_points_into(bar)
    finished = False
    try:
        with open_executor(executor, min(jobs - 1, len(rest)), ray_address, counter) as workers:
            tick = bar.poll if bar is not None else None
            done = workers.start(_summary_row, str(path), rest, tick)
            primary = _replay(sources[0], resolved[0], progress, bar, alone=False)
            for i, row in workers.run_waiting():  # what no worker took yet runs here
                rows[i] = row
            for i, row in done:
                rows[i] = row
                if bar is not None and executor == "ray":  # Ray tasks count when they end
                    bar.update(sizes[i + 1] or 0)
        finished = True
    finally:
        count_points_into(before)
        if bar is not None:
            bar.close(finished)
    primary.sweep = [primary.summary_row(), *rows]
    return primary


def _point_size(source: Source, resolved: ResolvedConfig, progress: bool | None) -> int | None:
    """Request completions a point counts: its requests once per pass (None: unknown)."""
    total = _total(source, progress)
    if total is None:
        return None
    options = resolved.options
    if options.mode != "serving":
        return total
    if options.is_fleet:
        from prefixcache.replay.sim.fleet.simulator import FLEET_PASSES

        return total * len(FLEET_PASSES)
    return 2 * total


def _sweep_progress(
    path: str | Path, sizes: list[int | None], progress: bool | None
) -> SweepProgress | None:
    """One bar for every point of a sweep, wherever it runs."""
    if not progress_enabled(progress):
        return None
    total = None if any(n is None for n in sizes) else sum(n or 0 for n in sizes)
    label = f"sweep {Path(path).name} ({len(sizes)} points)"
    return SweepProgress(total, label, shared_counter())


def _counted_into(items: Iterable[T], bar: PointProgress) -> Iterator[T]:
    """``items``, each counted on a sweep's bar as it is taken (the bar stays open)."""
    update = bar.update
    for item in items:
        yield item
        update()


# ---- progress ----------------------------------------------------------------------------------


def _total(source: Source, progress: bool | None) -> int | None:
    """Requests the source holds: known up front, or counted from a trace's lines when a bar is
    shown (a read of the file without parsing it)."""
    if source.total is not None or not progress_enabled(progress):
        return source.total
    return count_lines(source.path) if source.kind in LINE_TRACE_KINDS else None


def _serving_progress(
    source: Source, resolved: ResolvedConfig, progress: bool | None
) -> Progress | None:
    """A serving replay's bar, counting completed requests: each request completes twice,
    with the cache and in the no-cache simulation; in a fleet replay three times, the pooled
    cache's pass after those two (``FLEET_PASSES``)."""
    options = resolved.options
    if options.mode != "serving" or not progress_enabled(progress):
        return None
    total = _total(source, progress)
    if options.is_fleet:
        from prefixcache.replay.sim.fleet.simulator import FLEET_PASSES

        passes = len(FLEET_PASSES)
        label = f"replay {source.name} ({passes} passes)"
    else:
        passes, label = 2, f"replay {source.name} (with and without cache)"
    return Progress(passes * total if total is not None else None, label)


def with_progress(
    items: Iterable[T], total: int | None, label: str, enabled: bool | None = None
) -> Iterator[T]:
    """``items`` with a progress bar on stderr counting them; None: when it is a terminal."""
    if not progress_enabled(enabled):
        return iter(items)  # nothing to count: no generator between the replay and its source
    return _with_bar(items, total, label)


def _with_bar(items: Iterable[T], total: int | None, label: str) -> Iterator[T]:
    """``items`` counted on a bar, which appears when the first item is taken."""
    yield from counted(items, Progress(total, label))
