"""Where the secondary points of a sweep run: in this process, local processes, or Ray tasks.

Every executor takes the same work, a sweep point (the source path and its resolved
configuration) replayed by ``point``, and hands back each point's summary row as soon as that
point finishes, tagged with its position, so the caller can place it in the sweep table. The
primary point runs in this process while the others run.

Ray: each point is a Ray task; the workers open the source themselves, so the path must be
readable where they run (a shared filesystem on a multi-node cluster) and prefixcache installed
there. ``address`` is passed to ``ray.init`` (``auto``, ``ray://host:port``; None starts a local
instance or joins the one ``RAY_ADDRESS`` names). A Ray instance the executor started is shut
down when it closes; one already initialized is left running.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from types import TracebackType
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.replay.run_config import ResolvedConfig

EXECUTORS = ("local", "ray")

Row = dict[str, Any]
Point = Callable[[str, ResolvedConfig], Row]
Finished = Iterator[tuple[int, Row]]  # (position, row) of each point as it finishes


class SweepExecutor:
    """Runs sweep points in this process, one after the other, when their rows are asked for."""

    def __enter__(self) -> SweepExecutor:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self, point: Point, path: str, configs: list[ResolvedConfig]) -> Finished:
        """Start every point; yields ``(position, row)`` as points finish."""
        return ((i, point(path, c)) for i, c in enumerate(configs))

    def close(self) -> None:
        """Release the workers."""


class ProcessExecutor(SweepExecutor):
    """Points in a pool of local processes (fork where available)."""

    def __init__(self, workers: int) -> None:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self._pool = ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx)

    def start(self, point: Point, path: str, configs: list[ResolvedConfig]) -> Finished:
        futures: dict[Future[Row], int] = {
            self._pool.submit(point, path, c): i for i, c in enumerate(configs)
        }
        return ((futures[f], f.result()) for f in as_completed(futures))

    def close(self) -> None:
        self._pool.shutdown()


class RayExecutor(SweepExecutor):
    """Points as Ray tasks, one CPU each."""

    def __init__(self, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "--executor ray needs the 'ray' package: pip install 'prefixcache[ray]'"
            ) from None
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError as exc:
                raise ConfigError(f"cannot reach the Ray cluster at {address}: {exc}") from None

    def start(self, point: Point, path: str, configs: list[ResolvedConfig]) -> Finished:
        ray = self._ray
        task = ray.remote(num_cpus=1)(point)
        refs = {task.remote(path, c): i for i, c in enumerate(configs)}
        return self._as_completed(refs)

    def _as_completed(self, refs: dict[Any, int]) -> Finished:
        ray, waiting = self._ray, list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            for ref in done:
                yield refs[ref], ray.get(ref)

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()


def check_executor(kind: str, address: str | None) -> None:
    """Raise ConfigError unless ``kind`` is an executor and ``address`` fits it."""
    if kind not in EXECUTORS:
        raise ConfigError(f"unknown executor {kind!r}; choose one of {', '.join(EXECUTORS)}")
    if address is not None and kind != "ray":
        raise ConfigError("--ray-address needs --executor ray")


def open_executor(kind: str, workers: int, address: str | None = None) -> SweepExecutor:
    """The executor for ``kind`` (``local``: ``workers`` processes, or this process for none)."""
    check_executor(kind, address)
    if kind == "ray":
        return RayExecutor(address)
    return ProcessExecutor(workers) if workers > 0 else SweepExecutor()
