"""The subscriber's per-replica queues: messages its poller read, applied in order by a pool of
worker threads, one worker at a time per replica, so that a replica whose batch waits on its
replay endpoint holds up no other replica's messages."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)


class ReplicaInboxes:
    """Queues ``(replica, frames)`` for ``apply`` on ``workers`` threads; ``after()`` runs on a
    worker once its replica's queue is empty (the index's flush)."""

    def __init__(
        self,
        workers: int,
        apply: Callable[[str, list[bytes]], None],
        after: Callable[[], object] | None = None,
    ) -> None:
        self.workers = workers
        self._apply = apply
        self._after = after
        # the first message of a queue is the one being applied: a replica with any is a worker's
        self._queues: dict[str, deque[list[bytes]]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._stopping = threading.Event()

    @property
    def on_worker(self) -> bool:
        """Whether the calling thread is one of the workers."""
        return getattr(self._local, "active", False)

    def start(self) -> None:
        self._stopping.clear()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kv-ingest")

    def stop(self) -> None:
        """Drop what is queued; wait for each worker to end the message it applies."""
        self._stopping.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            self._queues.clear()

    def put(self, replica: str, frames: list[bytes]) -> None:
        """Queue a message; start a worker on the replica if none is on it."""
        with self._lock:
            queue = self._queues.setdefault(replica, deque())
            queue.append(frames)
            if len(queue) > 1 or self._pool is None:
                return
            self._pool.submit(self._work, replica)

    def nudge(self, replica: str) -> None:
        """Have a worker call ``apply(replica, [])`` (retry what waits), unless the replica's
        queue holds messages: its worker is on it and retries before the next one."""
        with self._lock:
            if self._queues.get(replica):
                return
        self.put(replica, [])

    def _work(self, replica: str) -> None:
        self._local.active = True
        while True:
            with self._lock:
                queue = self._queues.get(replica)
                if not queue:
                    return
                frames = queue[0]
            try:
                self._apply(replica, frames)
            except Exception:  # counted where it can be; the replica's next messages go on
                log.exception("replica %s: message not applied", replica)
            with self._lock:
                queue.popleft()
                if not queue or self._stopping.is_set():
                    self._queues.pop(replica, None)
                    break
        if self._after is not None:
            try:
                self._after()
            except Exception:  # the index counts its own failures; keep ingesting
                log.exception("flushing the fleet index failed")
