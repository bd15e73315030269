"""A one-replica serving replay's passes: the cached one here (``serving.Simulator`` over the
cache manager), and the same requests at the same capacity on a replica that caches nothing, for
the no-cache figures. Where a second core is usable, the no-cache pass runs in a second process
while the cached one runs (``side_process``), and the infinite-cache shadow goes with it, made
from the log of observations the cached pass streams there (``shadow_feed``); else both run
here, after the cached pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from prefixcache.manager.cache_manager import CacheManager
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.run_result import ServingStats
from prefixcache.replay.sim.accounting import Accountant, ShadowAnswers
from prefixcache.replay.sim.serving import Simulator
from prefixcache.replay.sim.serving_figures import BenchmarkFigures, OfferedLoad
from prefixcache.replay.sim.shadow_feed import (
    SHADOW_BATCH,
    ShadowFeed,
    ShadowMaker,
    answer_shadow,
    finish_shadow,
    paced_with_shadow,
)
from prefixcache.replay.sim.side_process import (
    FeedPipe,
    SideRun,
    side_process_available,
    skip_first,
)
from prefixcache.replay.sim.uncached_blocks import UncachedBlocks
from prefixcache.replay.tiers.admission import TierAdmitter
from prefixcache.replay.workload.request import Request

__all__ = ["run_serving"]


class _NoCacheLine(NamedTuple):
    """What the serving figures need of the no-cache pass."""

    ttft: list[float]  # by request index
    figures: BenchmarkFigures
    busy: float  # GPU seconds


_SideLines = tuple[_NoCacheLine, ShadowAnswers | None]


def _side_passes(
    reopen: Callable[[], Iterable[Request]],
    cfg: ResolvedConfig,
    on_finish: Callable[[int], None] | None,
    pipe: FeedPipe | None,
    track_isolation: bool,
) -> _SideLines:
    """The side process's work: the no-cache pass, then the shadow over the log ``pipe``
    brings (where the cached pass defers it)."""
    if pipe is None:
        return _no_cache_pass(reopen(), cfg, on_finish), None
    maker = ShadowMaker(cfg.options.block_size, track_isolation)
    line = _no_cache_pass(paced_with_shadow(reopen(), pipe, maker), cfg, on_finish)
    return line, finish_shadow(pipe, maker)


def _no_cache_pass(
    requests: Iterable[Request], cfg: ResolvedConfig, on_finish: Callable[[int], None] | None
) -> _NoCacheLine:
    """``requests`` on a replica of the same capacity that caches nothing."""
    base = Simulator(UncachedBlocks(cfg.capacity_blocks, cfg.options.block_size), cfg, None)
    base.on_finish = on_finish
    base.run(requests)
    return _NoCacheLine(base.times.ttft, base.figures(), base.busy)


def run_serving(
    requests: Iterable[Request],
    mgr: CacheManager,
    acc: Accountant,
    cfg: ResolvedConfig,
    on_finish: Callable[[int], None] | None = None,
    tiers: TierAdmitter | None = None,
    *,
    reopen: Callable[[], Iterable[Request]] | None = None,
) -> ServingStats:
    """Simulate ``requests`` with the cache, then the same requests without it, at the same
    capacity, for the no-cache figures. ``on_finish`` is told how many requests completed, step
    by step, in both simulations. ``tiers``: admit through the host tier and pool it manages
    (their loads add to the step times).

    ``reopen``: where given (``reopen()`` yields the requests again) and a second core is
    usable, the no-cache pass runs over it in a second process while the cached one runs here
    (``side_process``), and the infinite-cache shadow with it, from the log of observations
    this pass streams there (``shadow_feed``); else both here, after this pass: the no-cache
    pass over the lengths this pass kept."""
    side: SideRun[_SideLines] | None = None
    feed: ShadowFeed | None = None
    if reopen is not None and side_process_available():
        # the shadow goes with the no-cache pass (shadow_feed), unless it keeps nothing
        pipe = FeedPipe() if acc.shadow.enabled and acc.deferred is None else None
        track = acc.shadow.track_isolation
        try:
            side = SideRun(
                lambda count, stage: _side_passes(reopen, cfg, count, pipe, track), feed=pipe
            )
        except OSError:  # no process to be had (memory, process limits): both passes here
            side = None
        if side is not None and pipe is not None:
            feed = ShadowFeed(pipe)
            acc.defer_shadow(feed, SHADOW_BATCH)
    lines: _SideLines | None = None
    sim = Simulator(mgr, cfg, acc)
    sim.tiers = tiers
    try:
        sim.on_finish = _with_side_counts(on_finish, side)
        sim.run(requests)
        if feed is not None:
            assert acc.deferred is not None
            acc.deferred.flush()
            feed.end()
        if side is not None:
            lines = side.result(lambda: _count_side(on_finish, side))
            _count_side(on_finish, side)
    finally:
        if side is not None:
            side.stop()
    if lines is not None:
        line, answers = lines
    else:  # no second process, or it ended without its figures: run it here
        counted = side.taken if side is not None else 0  # on the bar already
        line = _no_cache_pass(sim.times.lengths_only(), cfg, skip_first(on_finish, counted))
        answers = None
    if feed is not None:  # the shadow's answers: the side's, else made here from the log
        if answers is None:
            assert reopen is not None
            answers = answer_shadow(reopen(), feed.batches(), cfg.options.block_size, track)
        feed.close()
        acc.settle_shadow(answers)
    times = sim.times
    return ServingStats(
        times.ttft,
        line.ttft,
        sim.preemptions,
        sim.steps,
        sim.clock - min(times.arrival, default=sim.clock),  # first arrival to last finish
        sim.truncated,
        with_cache=sim.figures(),
        without_cache=line.figures,
        load=OfferedLoad(
            times.span,
            sim.busy,
            line.busy,
            cfg.options.rate_scale / cfg.options.time_scale,
            ttft_growth_s=times.ttft_growth(),
        ),
        assumptions=sim.roof.assumptions(),
    )


def _with_side_counts(
    on_finish: Callable[[int], None] | None, side: SideRun[_SideLines] | None
) -> Callable[[int], None] | None:
    """``on_finish``, adding what the second process completed meanwhile."""
    if on_finish is None or side is None:
        return on_finish

    def counted(n: int) -> None:
        on_finish(n + side.counted())

    return counted


def _count_side(on_finish: Callable[[int], None] | None, side: SideRun[_SideLines]) -> None:
    """Count on the bar what the second process completed since it was last asked."""
    n = side.counted()
    if n and on_finish is not None:
        on_finish(n)
