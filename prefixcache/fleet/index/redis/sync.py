"""How the Redis fleet index stays in sync with Redis: the write queue, outages and resyncs.

Writes are script calls (``scripts``), queued and sent in pipelines of ``pipeline_size``
calls; ``flush()`` sends what is queued, and every read flushes first. Each pipeline also reads
``P:epoch``, a random token set once, which names the data in Redis.

Every write is also applied to a local ``MemoryFleetIndex`` (this instance's view). When Redis fails
(connection refused, reset, timeout), the error is counted, reads are answered from the local view,
the index is marked out of sync, and the writes Redis may have missed are kept (up to
``max_missed_args`` arguments). Reads time out after ``read_timeout`` (a hung Redis is answered for
from the local view); a request's read never waits for a reconnection: a watcher thread pings Redis
every ``retry_interval`` seconds without holding the index's lock and resynchronises once it answers
(a flush after ``retry_interval`` tries too). If Redis kept its data (the epoch is unchanged), the
missed writes are sent again: every script is idempotent, and what other routers wrote (blocks this
instance never saw stored, engine maps) stays. If Redis lost its data (a restart without
persistence: the epoch is gone; also noticed at any flush or match), the local view is added back
(each router adds its own, a union: one that joined a stream midway knows less), with the engine
maps its subscriber keeps and the last applied batches, in pipelines small enough to be answered
within the socket timeout. If too many writes were missed while Redis kept its data, each replica of
the local view is cleared in Redis and written back whole. Redis restored from an older snapshot
keeps its epoch: that is not noticed. An instance that only reads has an empty local view and
answers no holdings while Redis is away.

On a Redis Cluster a reply saying the slot moved makes the sync find the node serving it now and
send once more; the node is looked up again before every resync.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NamedTuple

import redis

from prefixcache.fleet.index.interface import CPU, GPU
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.scripts import (
    CAP_ERROR,
    IndexScripts,
    applied_args,
    as_bytes,
    remember_args,
    store_args,
)

log = logging.getLogger(__name__)

ScriptCall = tuple[Any, list[Any]]  # a registered script and its arguments
EngineSource = Callable[[str], list[tuple[bytes, bytes, int]]]

DEFAULT_READ_TIMEOUT = 0.5  # seconds a read may take before it is answered from the local view


class RedisIndexStats(NamedTuple):
    """What the Redis index has been through."""

    errors: int  # Redis calls that failed, and data losses noticed
    resyncs: int  # times brought back in sync (missed writes sent again, or the view written back)
    in_sync: bool  # False while Redis has missed writes
    overflow: int  # blocks refused at the per-replica cap (as Redis counted them)


class RedisSync:
    """The link of one index instance to Redis: its client, its queue of writes, its local view
    and what it knows Redis may lack (see the module docstring).

    Callers hold ``lock`` around a write to the local view and its ``enqueue``, so that the two
    stay in one order; ``flush``, ``read`` and the resync take it themselves."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str,
        scripts: IndexScripts,
        local: MemoryFleetIndex,
        pipeline_size: int,
        retry_interval: float,
        max_missed_args: int,
        locate: Callable[[], redis.Redis] | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.scripts = scripts
        self.local = local
        self.pipeline_size = pipeline_size
        self.retry_interval = retry_interval
        self.max_missed_args = max_missed_args
        self.lock = threading.RLock()
        # declared with every call, so a cluster checks the slot up front
        self.keys = [prefix + ":replicas"]
        self.applied: dict[str, str] = {}  # replica -> "seq ts" noted since the last flush
        self.applied_all: dict[str, str] = {}  # the same, written or not (for a write-back)
        self.engine_source: EngineSource | None = None
        self.dropped: set[str] = set()  # replicas whose drop Redis may not have had yet
        self.epoch: bytes | None = None  # the data's identity in Redis, as this instance saw it
        self.in_sync = True
        self.errors = 0
        self.resyncs = 0
        self.overflow = 0
        self._locate = locate
        self._queue: list[ScriptCall] = []
        # writes Redis may lack since it failed (sent again when it is back with its data);
        # None: more than max_missed_args arguments, so the local view is written back instead
        self._missed: list[ScriptCall] | None = []
        self._missed_args = 0
        self._last_try = 0.0
        self.read_timeout = read_timeout
        self._reader: tuple[redis.Redis, redis.Redis] | None = None  # (client, its reader)
        self._reader_lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None  # reconnects while out of sync

    def stats(self) -> RedisIndexStats:
        """Errors, resyncs, whether Redis is in sync, blocks refused at the cap."""
        return RedisIndexStats(self.errors, self.resyncs, self.in_sync, self.overflow)

    def enqueue(self, script: Any, args: list[Any]) -> None:
        """Queue one script call (kept as missed while Redis is out of sync); a full queue is
        sent at once. Call with ``lock`` held."""
        if not self.in_sync:
            self._log_missed([(script, args)])  # sent when Redis is back
            return
        self._queue.append((script, args))
        if len(self._queue) >= self.pipeline_size:
            self.flush()

    def read(self, call: Callable[[redis.Redis], Any], *, request: bool = False) -> Any:
        """``call(client)`` after a flush, on a client whose calls time out after
        ``read_timeout``, once more on a moved slot (Redis Cluster); None when Redis is away
        (the failure counted): the caller answers from the local view. ``request``: on the
        path of a request, which never waits for a reconnection: None at once while out of
        sync (the watcher thread reconnects), or when the lock is not free within
        ``read_timeout`` (a write stuck on a hung Redis holds it)."""
        if request:
            if not self.in_sync or not self.lock.acquire(timeout=self.read_timeout):
                return None
        else:
            self.lock.acquire()
        try:
            if request and not self.in_sync:  # went out of sync while this call waited
                return None
            client = self.reader()
            if not self.flush(client if request else None):
                return None
            try:
                return call(client)
            except redis.RedisError as exc:
                if self._moved(exc):
                    with suppress(redis.RedisError):
                        return call(self.reader())
                self.failed(exc)
                return None
        finally:
            self.lock.release()

    def reader(self) -> redis.Redis:
        """A client of the same Redis as ``client`` whose calls time out after
        ``read_timeout``."""
        client = self.client
        with self._reader_lock:
            if self._reader is not None and self._reader[0] is client:
                return self._reader[1]
            pool = getattr(client, "connection_pool", None)
            if pool is None:
                return client
            kwargs = dict(pool.connection_kwargs)
            kwargs["socket_timeout"] = self.read_timeout
            connect = kwargs.get("socket_connect_timeout")
            kwargs["socket_connect_timeout"] = min(connect or self.read_timeout, self.read_timeout)
            reader = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, **kwargs
                )
            )
            old, self._reader = self._reader, (client, reader)
        if old is not None:
            old[1].close()
        return reader

    def flush(self, client: redis.Redis | None = None) -> bool:
        """Send the queued writes (resynchronising first if Redis missed some; on ``client``
        when given); True when Redis is in sync afterwards."""
        with self.lock:
            if not self.in_sync:
                return self.try_resync()
            if self.applied:  # one write per replica per flush, whatever the batches
                self._queue.append((self.scripts.applied, applied_args(self.prefix, self.applied)))
                self.applied.clear()
            if not self._queue:
                return True
            queue, self._queue = self._queue, []
            try:
                if self.epoch is None:
                    self.epoch = self._claim_epoch(client)
                epoch, results = self._send(queue, client)
                moved = next((r for r in results if isinstance(r, Exception)), None)
                if moved is not None and self._moved(moved):  # the writes are idempotent
                    epoch, results = self._send(queue)
            except redis.RedisError as exc:
                self._queue = queue + self._queue  # sent again once Redis is back
                self.failed(exc)
                return False
            for result in results:
                if isinstance(result, Exception):
                    if CAP_ERROR in str(result):  # another instance filled the replica table
                        self.overflow += 1
                        continue
                    self._queue = queue + self._queue
                    self.failed(result)
                    return False
                self.overflow += int(result or 0)
            if epoch != self.epoch:  # Redis lost its data since the last flush (a restart)
                self.lost_data()
                return self.try_resync()
            self.dropped.clear()
            return True

    def failed(self, exc: BaseException) -> None:
        """Redis failed a call: counted; out of sync until a resync, the queued writes kept as
        missed."""
        self.errors += 1
        if self.in_sync:
            log.warning("Redis fleet index unreachable (%s); answering from the local view", exc)
        self.in_sync = False
        self._log_missed(self._queue)
        self._queue = []
        self._last_try = time.monotonic()
        self._watch()

    def lost_data(self) -> None:
        """Redis lost its data (its epoch changed): the local view goes back at the next try."""
        log.warning("Redis fleet index lost its data; writing the local view back")
        self.errors += 1
        self.in_sync, self._missed, self._last_try = False, None, 0.0
        self._watch()

    def relocate(self) -> bool:
        """Point the client at the node serving the index's slot (Redis Cluster); False, and
        counted as a failure, when the cluster cannot say."""
        if self._locate is None:
            return True
        try:
            client = self._locate()
        except Exception as exc:  # any failure to ask the cluster counts as Redis being away
            self.failed(exc)
            return False
        if client is not self.client:
            self.client.close()
            self.client = client
        return True

    def try_resync(self) -> bool:
        """Once ``retry_interval`` has passed since the last try: reconnect and bring Redis back
        in sync (the missed writes sent again, or the local view written back). True when in
        sync."""
        now = time.monotonic()
        if now - self._last_try < self.retry_interval:
            return False
        self._last_try = now
        if not self.relocate():
            return False
        try:
            self.client.ping()
            epoch = self.client.get(self.prefix + ":epoch")
            missed = self._missed
            # Redis kept its data: the epoch this instance saw, or any when it never saw one
            kept = (
                None
                if epoch is None or self.epoch not in (None, as_bytes(epoch))
                else as_bytes(epoch)
            )
            if kept is not None and missed is not None:
                self.epoch = kept
                return self._send_missed(missed)
            # Redis lost its data, or too many writes were missed: the local view goes back.
            # Added, not put in place, after a loss: another router's view (blocks this one
            # never saw stored) may be there already
            calls = self._write_back(behind=kept is not None)
            for i in range(0, len(calls), 16):  # pipelines Redis answers within the timeout
                pipe = self.client.pipeline(transaction=False)
                for script, script_args in calls[i : i + 16]:
                    script(keys=self.keys, args=script_args, client=pipe)
                pipe.execute()
            self.epoch = self._claim_epoch()
        except redis.RedisError as exc:
            return self._still_away(exc)
        return self._back(f"back; wrote the local view of {len(self.local.replicas())} replicas")

    def _write_back(self, *, behind: bool) -> list[ScriptCall]:
        """The calls that put this instance's view back: its replicas' blocks, the engine maps
        its subscriber keeps and the last applied batches; first the drops Redis may lack and,
        when ``behind`` on writes Redis had, a clear of each replica (what it removed must go)."""
        prefix, scripts, local = self.prefix, self.scripts, self.local
        calls: list[ScriptCall] = []
        for replica in sorted(self.dropped):  # dropped while Redis was away
            calls.append((scripts.clear, [prefix, replica, 1]))
        cap, max_replicas = local.max_blocks_per_replica, local.max_replicas
        for replica in local.replicas():
            if behind:
                calls.append((scripts.clear, [prefix, replica, 0]))
            by_medium: dict[str, list[bytes]] = {GPU: [], CPU: []}
            for d, media in local.holdings(replica).items():
                for m in media:
                    by_medium[m].append(d)
            for medium, digests in by_medium.items():
                for i in range(0, len(digests), 1024):
                    chunk = digests[i : i + 1024]
                    args = store_args(prefix, replica, medium, chunk, cap, max_replicas)
                    calls.append((scripts.store, args))
            if self.engine_source is not None:  # and the engine map, as the caller knows it
                entries = self.engine_source(replica)
                for i in range(0, len(entries), 1024):
                    args = remember_args(prefix, replica, entries[i : i + 1024])
                    calls.append((scripts.remember, args))
        if self.applied_all:
            calls.append((scripts.applied, applied_args(prefix, self.applied_all)))
        return calls

    def close(self) -> None:
        """Send what is queued (if Redis is there) and close the connections."""
        self._closed.set()
        with self.lock:
            self.flush()
            self.client.close()
            if self._reader is not None:
                self._reader[1].close()

    # ---- the watcher: reconnects off the request path -------------------------------------
    def _watch(self) -> None:
        """Start the watcher thread, unless it runs (call with ``lock`` held)."""
        if self._watcher is None and not self._closed.is_set():
            self._watcher = threading.Thread(
                target=self._reconnect, name="redis-index-reconnect", daemon=True
            )
            self._watcher.start()

    def _reconnect(self) -> None:
        """While out of sync: every ``retry_interval`` a ping with the read timeout (no lock
        held, so a hung Redis holds nobody up); once Redis answers, the resync."""
        while not self._closed.wait(0.05):
            if self.in_sync:
                with self.lock:
                    if self.in_sync:
                        self._watcher = None
                        return
                continue
            if time.monotonic() - self._last_try < self.retry_interval:
                continue
            if self._locate is None:  # on a cluster the resync finds the node first
                try:
                    self.reader().ping()
                except Exception as exc:  # any failure: still away
                    self._last_try = time.monotonic()
                    log.debug("Redis fleet index still unreachable: %s", exc)
                    continue
            with self.lock:
                if not self.in_sync:
                    self.try_resync()
        with self.lock:
            self._watcher = None

    # ---- internals ------------------------------------------------------------------------
    def _send(
        self, queue: list[ScriptCall], client: redis.Redis | None = None
    ) -> tuple[Any, list[Any]]:
        """Run queued script calls in one pipeline (on ``client``, by default the index's),
        after reading the data's epoch; per-call errors come back as results."""
        pipe = (client or self.client).pipeline(transaction=False)
        pipe.get(self.prefix + ":epoch")
        keys = self.keys
        for script, args in queue:
            script(keys=keys, args=args, client=pipe)
        epoch, *results = pipe.execute(raise_on_error=False)
        if isinstance(epoch, Exception):  # as any other call's error (a moved slot, say)
            return None, [epoch, *results]
        return epoch, results

    def _claim_epoch(self, client: redis.Redis | None = None) -> bytes:
        """The epoch of the data in Redis, set now if it has none (a fresh or emptied Redis)."""
        key = self.prefix + ":epoch"
        pipe = (client or self.client).pipeline(transaction=False)
        pipe.set(key, uuid.uuid4().hex, nx=True)
        pipe.get(key)
        return as_bytes(pipe.execute()[1])

    def _log_missed(self, calls: list[ScriptCall]) -> None:
        if self._missed is None:
            return
        self._missed_args += sum(len(args) for _, args in calls)
        if self._missed_args > self.max_missed_args:  # the local view is written back instead
            self._missed, self._missed_args = None, 0
        else:
            self._missed.extend(calls)

    def _moved(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the slot lives elsewhere now (Redis Cluster) and the node serving
        it was found: then the caller tries once more before counting a failure."""
        if self._locate is None or not isinstance(exc, redis.exceptions.MovedError):
            return False
        return self.relocate()

    def _send_missed(self, missed: list[ScriptCall]) -> bool:
        """Redis is back with its data: send the writes it missed (idempotent scripts)."""
        try:
            for i in range(0, len(missed), 1024):
                epoch, results = self._send(missed[i : i + 1024])
                for result in results:
                    if isinstance(result, Exception) and CAP_ERROR not in str(result):
                        raise result
                if epoch != self.epoch:
                    raise redis.RedisError("the data changed while the missed writes were sent")
        except redis.RedisError as exc:
            return self._still_away(exc)
        return self._back(f"back with its data; sent the {len(missed)} writes it missed")

    def _still_away(self, exc: BaseException) -> bool:
        self.errors += 1
        log.debug("Redis fleet index still unreachable: %s", exc)
        return False

    def _back(self, how: str) -> bool:
        """In sync again: nothing is missed any more."""
        self.in_sync = True
        self.dropped.clear()
        self._missed, self._missed_args = [], 0
        self.resyncs += 1
        log.warning("Redis fleet index %s", how)
        return True
