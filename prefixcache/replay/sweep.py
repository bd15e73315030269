"""Several cache configurations over one workload, in parallel processes.

The first configuration is the primary run (full per-request rows); the others report one line
each. Workers re-open the source themselves, so nothing large crosses process boundaries.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from prefixcache.replay.config import ReplayConfig
from prefixcache.replay.result import ReplayResult
from prefixcache.replay.run import replay_path
from prefixcache.replay.sources import open_source


def _summary(path: str, config: ReplayConfig) -> dict[str, Any]:
    return replay_path(path, config.with_(record=False)).summary_row()


def replay_sweep(
    path: str | Path,
    configs: list[ReplayConfig],
    *,
    jobs: int | None = None,
    progress: bool | None = False,
) -> ReplayResult:
    """Replay ``configs[0]`` in full and every config's summary; ``result.sweep`` lists them."""
    if not configs:
        raise ValueError("replay_sweep needs at least one configuration")
    for c in configs:  # fail fast, before any process starts
        c.resolve()
        open_source(path, c)
    rest = configs[1:]
    jobs = max(1, jobs or min(len(configs), os.cpu_count() or 1))
    if not rest:
        return replay_path(path, configs[0], progress=progress)
    if jobs == 1:
        primary = replay_path(path, configs[0], progress=progress)
        rows = [_summary(str(path), c) for c in rest]
    else:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(max_workers=min(jobs - 1, len(rest)) or 1, mp_context=ctx) as pool:
            futures = [pool.submit(_summary, str(path), c) for c in rest]
            primary = replay_path(path, configs[0], progress=progress)
            rows = [f.result() for f in futures]
    primary.sweep = [primary.summary_row(), *rows]
    return primary
