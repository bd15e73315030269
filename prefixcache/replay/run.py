"""Run one replay: open the source, build the cache manager, drive it, collect the result."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from prefixcache.manager import CacheManager
from prefixcache.replay.accounting import Accountant
from prefixcache.replay.config import ReplayConfig
from prefixcache.replay.progress import with_progress
from prefixcache.replay.request import Request
from prefixcache.replay.result import ReplayResult
from prefixcache.replay.sequential import run_sequential
from prefixcache.replay.sources import Source, open_source


def replay_source(
    source: Source, config: ReplayConfig, *, progress: bool | None = False
) -> ReplayResult:
    """Replay ``source`` through a fresh CacheManager. ``progress``: None shows a bar when
    stderr is a terminal."""
    resolved = config.resolve()
    mgr = CacheManager(
        resolved.capacity_blocks,
        config.block_size,
        hash_algo=config.hash_algo,
        policy=config.policy,
        partial_copy=config.partial_copy,
    )
    acc = Accountant(
        config.block_size, mgr.hasher, track_isolation=source.multi_namespace, record=config.record
    )
    requests = with_progress(source, source.total, f"replay {source.name}", progress)
    start = time.perf_counter()
    serving = None
    with _no_automatic_gc():
        if config.mode == "sequential":
            truncated = run_sequential(requests, mgr, acc)
        else:
            from prefixcache.replay.serving import run_serving

            serving = run_serving(requests, source, mgr, acc, resolved)
            truncated = serving.truncated
    elapsed = time.perf_counter() - start
    info = {
        "path": source.path,
        "kind": source.kind,
        "sha256": source.sha256(),
        "name": source.name,
    }
    return ReplayResult(info, resolved, source.seed, acc, mgr.stats, elapsed, serving, truncated)


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
    return replay_source(open_source(path, config), config, progress=progress)
