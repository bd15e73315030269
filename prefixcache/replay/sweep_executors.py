"""Where the secondary points of a sweep run: in this process, local processes, or Ray tasks.

Every executor takes the same work, a sweep point (the source path and its resolved
configuration) replayed by ``point``, and hands back each point's summary row as soon as that
point finishes, tagged with its position, so the caller can place it in the sweep table. The
primary point runs in this process while the others run; once it is done, this process takes
the points no worker has started yet (``run_waiting``), so every core stays busy to the end.

Progress: local worker processes add the requests their points complete to one shared count
(``SharedProgress``), which the sweep's bar in this process reads (``point_progress`` is where
a point running in any process counts); a point on Ray counts when its row comes back.

Ray: each point is a Ray task; the workers open the source themselves, so the path must be
readable where they run (a shared filesystem on a multi-node cluster) and prefixcache installed
there. ``address`` is passed to ``ray.init`` (``auto``, ``ray://host:port``; None starts a local
instance or joins the one ``RAY_ADDRESS`` names). A Ray instance the executor started is shut
down when it closes; one already initialized is left running.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Protocol

from prefixcache.errors import ConfigError
from prefixcache.replay.run_config import ResolvedConfig

EXECUTORS = ("local", "ray")

Row = dict[str, Any]
Point = Callable[[str, ResolvedConfig], Row]
Finished = Iterator[tuple[int, Row]]  # (position, row) of each point as it finishes
POLL_S = 0.5  # seconds between reads of the workers' count while waiting for their rows


class PointProgress(Protocol):
    """What a replay counts its completed requests into (a ``progress.Progress`` or a
    worker's ``SharedProgress``)."""

    def update(self, n: int = 1) -> None: ...

    def stage(self, name: str) -> None: ...

    def close(self, finished: bool = True) -> None: ...


_progress: PointProgress | None = None  # where sweep points running in this process count


def point_progress() -> PointProgress | None:
    """Where a sweep point replayed in this process counts its requests (None: nowhere)."""
    return _progress


def point_done() -> None:
    """A point ended in this process: a worker sends what it counted at once."""
    if isinstance(_progress, SharedProgress):
        _progress.close()


def count_points_into(progress: PointProgress | None) -> PointProgress | None:
    """Make ``progress`` where this process's sweep points count; returns the one before."""
    global _progress
    before, _progress = _progress, progress
    return before


class SharedProgress:
    """A worker process's part of the sweep's bar: counts added to a shared value (about
    twice a second, and when a point ends) that the sweep's process reads."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter  # a multiprocessing.Value("q")
        self.pending = 0
        self.sent_at = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.pending += n
        if time.monotonic() - self.sent_at >= POLL_S:
            self.close()

    def stage(self, name: str) -> None:
        """The sweep's bar names no pass."""

    def close(self, finished: bool = True) -> None:
        """Send what was counted."""
        if self.pending:
            with self.counter.get_lock():
                self.counter.value += self.pending
            self.pending = 0
        self.sent_at = time.monotonic()


def _context() -> Any:
    """Fork where available (workers start at once and share the loaded modules), else
    spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def shared_counter() -> Any:
    """A count worker processes can add to (for ``open_executor``'s ``counter``)."""
    return _context().Value("q", 0)


def _join_sweep(counter: Any) -> None:
    """A worker process's start: count its points into the sweep's shared value."""
    count_points_into(SharedProgress(counter) if counter is not None else None)


class SweepExecutor:
    """Runs sweep points in this process, one after the other, when their rows are asked for."""

    def __enter__(self) -> SweepExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        point: Point,
        path: str,
        configs: list[ResolvedConfig],
        tick: Callable[[], None] | None = None,
    ) -> Finished:
        """Start every point; yields ``(position, row)`` as points finish. ``tick`` is called
        about every ``POLL_S`` seconds while rows are awaited from elsewhere."""
        return ((i, point(path, c)) for i, c in enumerate(configs))

    def run_waiting(self) -> Finished:
        """Run here, one at a time, the points no worker has started; yields their rows (the
        others still come from ``start``'s iterator)."""
        return iter(())

    def close(self) -> None:
        """Release the workers."""


class ProcessExecutor(SweepExecutor):
    """Points in a pool of local processes (fork where available). ``counter``: a shared
    ``multiprocessing.Value("q")`` the workers count completed requests into."""

    def __init__(self, workers: int, counter: Any = None) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=max(1, workers),
            mp_context=_context(),
            initializer=_join_sweep,
            initargs=(counter,),
        )
        self._futures: dict[Future[Row], int] = {}
        self._work: tuple[Point, str, list[ResolvedConfig]] | None = None

    def start(
        self,
        point: Point,
        path: str,
        configs: list[ResolvedConfig],
        tick: Callable[[], None] | None = None,
    ) -> Finished:
        self._work = (point, path, configs)
        self._futures = {self._pool.submit(point, path, c): i for i, c in enumerate(configs)}
        return self._finished(tick)

    def _finished(self, tick: Callable[[], None] | None) -> Finished:
        pending = set(self._futures)
        while pending:
            done, pending = wait(
                pending, timeout=POLL_S if tick is not None else None, return_when=FIRST_COMPLETED
            )
            if tick is not None:
                tick()
            for future in sorted(done, key=self._futures.__getitem__):
                if not future.cancelled():  # taken by run_waiting
                    yield self._futures[future], future.result()

    def run_waiting(self) -> Finished:
        if self._work is None:
            return
        point, path, configs = self._work
        for future, i in list(self._futures.items()):  # in order; a worker may start one first
            if future.cancel():
                yield i, point(path, configs[i])

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

    def start(
        self,
        point: Point,
        path: str,
        configs: list[ResolvedConfig],
        tick: Callable[[], None] | None = None,
    ) -> Finished:
        ray = self._ray
        task = ray.remote(num_cpus=1)(point)
        refs = {task.remote(path, c): i for i, c in enumerate(configs)}
        return self._as_completed(refs, tick)

    def _as_completed(self, refs: dict[Any, int], tick: Callable[[], None] | None) -> Finished:
        ray, waiting = self._ray, list(refs)
        timeout = POLL_S if tick is not None else None
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if tick is not None:
                tick()
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


def open_executor(
    kind: str, workers: int, address: str | None = None, counter: Any = None
) -> SweepExecutor:
    """The executor for ``kind`` (``local``: ``workers`` processes, or this process for none;
    ``counter``: the shared value their progress goes to)."""
    check_executor(kind, address)
    if kind == "ray":
        return RayExecutor(address)
    return ProcessExecutor(workers, counter) if workers > 0 else SweepExecutor()
