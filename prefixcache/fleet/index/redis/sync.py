"""How the Redis fleet index stays in sync with Redis: the write queue, outages and resyncs.

Writes are script calls (``scripts``), queued and sent in pipelines of ``pipeline_size`` calls
(``script_calls``); ``flush()`` sends what is queued, and every read flushes first. Each pipeline
also reads ``P:epoch``, a random token set once, which names the data in Redis.

No lock is held across a Redis call. ``lock`` keeps the local view and the queue in one order and
is held only while they change; one thread at a time talks to Redis for the queue (its turn,
taken and given back under the lock, so writes reach Redis in the order they were queued), the
others wait for the turn or leave their writes to it; a sender thread sends a full queue and
what was queued during another send. A request's read asks nothing while Redis has owed any
thread a reply for ``SLOW_REPLY_S`` (0.1 s) and waits no longer than that for a send: it answers
from the local view, so a hang stalls only the reads of its first moment, for ``read_timeout``.

Every write is also applied to a local ``MemoryFleetIndex`` (this instance's view). When Redis
fails (connection refused, reset, timeout), the error is counted, reads are answered from the
local view, the index is marked out of sync, and the writes Redis may have missed are kept (up to
``max_missed_args`` arguments). While out of sync no read asks Redis: the sender thread pings it
every ``retry_interval`` seconds and resynchronises once it answers (so does a flush after
``retry_interval``). If Redis kept its data (the epoch is unchanged), the missed writes are sent
again (every script is idempotent; what other routers wrote stays), then those missed meanwhile,
before the index counts as in sync. If Redis lost its data (a restart without persistence: the
epoch is gone; also noticed at any flush or match), the local view is added back (each router
adds its own, a union: one that joined a stream midway knows less), with the engine maps its
subscriber keeps and the last applied batches. If too many writes were missed while Redis kept
its data, each replica of the local view is cleared in Redis and written back whole. Redis
restored from an older snapshot keeps its epoch: that is not noticed. An instance that only reads
has an empty local view and answers no holdings while Redis is away.

On a Redis Cluster a reply saying the slot moved makes the sync find the node serving it now and
send once more; the node is looked up again before every resync.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NamedTuple

import redis

from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.connect import timed_client
from prefixcache.fleet.index.redis.script_calls import (
    EngineSource,
    ScriptCall,
    claim_epoch,
    send_calls,
    send_view,
    view_calls,
)
from prefixcache.fleet.index.redis.scripts import CAP_ERROR, IndexScripts, applied_args, as_bytes

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT = 0.5  # seconds a read may take before it is answered from the local view
# seconds Redis may owe a reply before requests answer from the local view without asking it:
# at the start of a hang, only the requests of that moment wait out their read timeout
SLOW_REPLY_S = 0.1
MISSED_CHUNK = 1024  # missed writes sent again per pipeline


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
    stay in one order; ``flush`` and ``read`` are called without it (they take it only between
    Redis calls)."""

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
        # the turn to talk to Redis for the queue or a resync: one thread at a time
        self._turn_ended = threading.Condition(self.lock)
        self._sending = False
        self._sending_since = 0.0  # when the current send's Redis call began
        self._waiting: dict[object, float] = {}  # reads waiting on Redis -> when they asked
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._asked = False  # the sender thread has queued writes to send
        self._sender: threading.Thread | None = None  # sends behind callers; reconnects

    def stats(self) -> RedisIndexStats:
        """Errors, resyncs, whether Redis is in sync, blocks refused at the cap."""
        return RedisIndexStats(self.errors, self.resyncs, self.in_sync, self.overflow)

    def enqueue(self, script: Any, args: list[Any]) -> None:
        """Queue one script call (kept as missed while Redis is out of sync); a full queue is
        left to the sender thread. Call with ``lock`` held."""
        if not self.in_sync:
            self._log_missed([(script, args)])  # sent when Redis is back
            return
        self._queue.append((script, args))
        if len(self._queue) >= self.pipeline_size:
            self._kick()

    def read(self, call: Callable[[redis.Redis], Any], *, request: bool = False) -> Any:
        """``call(client)`` after a flush, on a client whose calls time out after
        ``read_timeout``, once more on a moved slot (Redis Cluster); None when Redis is away or
        out of sync (the failure counted; the sender thread reconnects): the caller answers from
        the local view. ``request``: on the path of a request, which asks nothing while Redis
        has owed a reply (to any thread) for ``slow_reply`` seconds, and waits at most that
        long for a send under way. Call without ``lock``."""
        if not self.in_sync:
            return None
        client = self.reader()
        patience = self.slow_reply if request else None
        token = object()
        with self.lock:
            if request and self._owed(time.monotonic()) >= self.slow_reply:
                return None  # Redis is slow to answer now: answered locally meanwhile
            pending = self._sending or bool(self._queue) or bool(self.applied)
            if pending and not self._take_turn(patience=patience):
                return None  # a send under way hangs: answered locally meanwhile
            self._waiting[token] = time.monotonic()
        try:
            if pending:
                try:
                    sent = self._send_queue(client if request else None)
                finally:
                    self._end_turn()
                if not sent:
                    return None
                with self.lock:
                    self._waiting[token] = time.monotonic()
            return call(client)
        except redis.RedisError as exc:
            if self._moved(exc):
                with suppress(redis.RedisError):
                    return call(self.reader())
            self.failed(exc)
            return None
        finally:
            with self.lock:
                del self._waiting[token]

    @property
    def slow_reply(self) -> float:
        """Seconds Redis may owe a reply before requests stop asking it (until it answers or
        the read times out): ``SLOW_REPLY_S``, or ``read_timeout`` when that is shorter."""
        return min(SLOW_REPLY_S, self.read_timeout)

    def _owed(self, now: float) -> float:
        """How long Redis has owed the oldest reply a thread waits for (0: none). Call with
        ``lock`` held."""
        began = [*self._waiting.values(), *((self._sending_since,) if self._sending else ())]
        return now - min(began) if began else 0.0

    def reader(self) -> redis.Redis:
        """A client of the same Redis as ``client`` whose calls time out after
        ``read_timeout``."""
        client = self.client
        with self._reader_lock:
            if self._reader is not None and self._reader[0] is client:
                return self._reader[1]
            reader = timed_client(client, self.read_timeout)
            if reader is client:
                return client
            old, self._reader = self._reader, (client, reader)
        if old is not None:
            old[1].close()
        return reader

    def flush(self, client: redis.Redis | None = None, *, wait: bool = True) -> bool:
        """Send the queued writes (resynchronising first if Redis missed some, once
        ``retry_interval`` has passed; on ``client`` when given); True when Redis is in sync
        afterwards. A send under way is waited for (``wait=False``: the writes are left to it,
        or to the sender thread, and the answer is whether Redis is in sync now). Call without
        ``lock``."""
        with self.lock:
            if not self._take_turn(wait=wait):
                return self.in_sync
        try:
            if self.in_sync:
                return self._send_queue(client)
            return self._resync()
        finally:
            self._end_turn()

    def failed(self, exc: BaseException) -> None:
        """Redis failed a call: counted; out of sync until a resync, the queued writes kept as
        missed."""
        with self.lock:
            self.errors += 1
            if self.in_sync:
                log.warning(
                    "Redis fleet index unreachable (%s); answering from the local view", exc
                )
            self.in_sync = False
            self._log_missed(self._queue)
            self._queue = []
            self._last_try = time.monotonic()
            self._kick()

    def lost_data(self) -> None:
        """Redis lost its data (its epoch changed): the local view goes back at the next try."""
        with self.lock:
            log.warning("Redis fleet index lost its data; writing the local view back")
            self.errors += 1
            self.in_sync, self._missed, self._last_try = False, None, 0.0
            self._kick()

    def relocate(self) -> bool:
        """Point the client at the node serving the index's slot (Redis Cluster); False, and
        counted as a failure, when the cluster cannot say. Call without ``lock``."""
        if self._locate is None:
            return True
        try:
            client = self._locate()
        except Exception as exc:  # any failure to ask the cluster counts as Redis being away
            self.failed(exc)
            return False
        with self.lock:
            old, self.client = self.client, client
        if old is not client:
            old.close()
        return True

    def close(self) -> None:
        """Send what is queued (if Redis is there) and close the connections."""
        self._closed.set()
        self._wake.set()
        self.flush()
        self.client.close()
        if self._reader is not None:
            self._reader[1].close()

    # ---- the turn: one thread talks to Redis at a time --------------------------------------
    def _take_turn(self, *, wait: bool = True, patience: float | None = None) -> bool:
        """Take the turn to send, once the thread sending ends its own (``wait``; with
        ``patience``, only while that send's Redis call began less than ``patience`` seconds
        ago, for at most ``patience``). Call with ``lock`` held; True when taken."""
        deadline = None if patience is None else time.monotonic() + patience
        while self._sending:
            if not wait:
                return False
            timeout = None
            if patience is not None and deadline is not None:
                timeout = min(deadline, self._sending_since + patience) - time.monotonic()
                if timeout <= 0:
                    return False
            self._turn_ended.wait(timeout)
        self._sending = True
        self._sending_since = time.monotonic()
        return True

    def _end_turn(self) -> None:
        """Give the turn back; writes queued meanwhile go to the sender thread."""
        with self.lock:
            self._sending = False
            self._turn_ended.notify_all()
            if self.in_sync and (self._queue or self.applied):
                self._kick()

    def _send_queue(self, client: redis.Redis | None = None) -> bool:
        """Send the queue in pipelines until it is empty, holding the turn (not the lock);
        False, the writes kept, when Redis failed or was out of sync."""
        while True:
            with self.lock:
                if not self.in_sync:
                    return False
                if self.applied and len(self._queue) < self.pipeline_size:
                    # one write per replica per flush, whatever the batches
                    args = applied_args(self.prefix, self.applied)
                    self._queue.append((self.scripts.applied, args))
                    self.applied.clear()
                if not self._queue:
                    self.dropped.clear()
                    return True
                batch = self._queue[: self.pipeline_size]
                del self._queue[: self.pipeline_size]
                known = self.epoch
                self._sending_since = time.monotonic()
            try:
                if known is None:
                    known = claim_epoch(client or self.client, self.prefix)
                    with self.lock:
                        self.epoch = known
                epoch, results = self._send(batch, client)
                moved = next((r for r in results if isinstance(r, Exception)), None)
                if moved is not None and self._moved(moved):  # the writes are idempotent
                    epoch, results = self._send(batch)
            except redis.RedisError as exc:
                self._unsent(batch, exc)
                return False
            with self.lock:
                for result in results:
                    if isinstance(result, Exception):
                        if CAP_ERROR in str(result):  # another instance filled the replica table
                            self.overflow += 1
                            continue
                        self._unsent(batch, result)
                        return False
                    self.overflow += int(result or 0)
                lost = epoch != self.epoch  # Redis lost its data since the last flush
                if lost:
                    self.lost_data()
            if lost:
                return self._resync()

    def _unsent(self, batch: list[ScriptCall], exc: BaseException) -> None:
        """``batch``, taken from the queue, was not sent: it goes back ahead of every later
        write (the queue's, or the missed writes' once out of sync)."""
        with self.lock:
            if self.in_sync:
                self._queue[:0] = batch
                self.failed(exc)
                return
            self.errors += 1
            self._put_back(batch)

    # ---- outages -----------------------------------------------------------------------------
    def _resync(self) -> bool:
        """Once ``retry_interval`` has passed since the last try: reconnect and bring Redis back
        in sync (the missed writes sent again, or the local view written back), then the writes
        missed meanwhile, holding the turn (not the lock). True when in sync."""
        with self.lock:
            now = time.monotonic()
            if now - self._last_try < self.retry_interval:
                return False
            self._last_try = self._sending_since = now
        if not self.relocate():
            return False
        client = self.client
        try:
            client.ping()
            epoch = client.get(self.prefix + ":epoch")
        except redis.RedisError as exc:
            return self._still_away(exc)
        how = None
        while True:
            with self.lock:
                # Redis kept its data: the epoch this instance saw, or any when it never saw one
                kept = (
                    None
                    if epoch is None or self.epoch not in (None, as_bytes(epoch))
                    else as_bytes(epoch)
                )
                view = kept is None or self._missed is None
                if not view:
                    self.epoch = kept
                    if how is not None and not self._missed:  # nothing missed any more
                        return self._back(how)
                    calls, self._missed, self._missed_args = self._missed or [], [], 0
                else:
                    # lost, or too many writes missed: the local view goes back. Added, not put
                    # in place, after a loss: another router's view (blocks this one never saw
                    # stored) may be there already
                    calls = view_calls(
                        self.prefix,
                        self.scripts,
                        self.local,
                        dropped=self.dropped,
                        engine_source=self.engine_source,
                        applied=self.applied_all,
                        behind=kept is not None,
                    )
                    self._missed, self._missed_args = [], 0  # what comes meanwhile, after it
                    replicas = len(self.local.replicas())
                self._sending_since = time.monotonic()
            done = 0
            try:
                if view:
                    send_view(client, self.keys, calls)
                    epoch = claim_epoch(self.client, self.prefix)
                    with self.lock:
                        self.epoch = epoch
                    how = f"back; wrote the local view of {replicas} replicas"
                else:
                    for done in range(0, len(calls), MISSED_CHUNK):
                        got, results = self._send(calls[done : done + MISSED_CHUNK])
                        for result in results:
                            if isinstance(result, Exception) and CAP_ERROR not in str(result):
                                raise result
                        if got != kept:
                            raise redis.RedisError(
                                "the data changed while the missed writes were sent"
                            )
                    how = how or f"back with its data; sent the {len(calls)} writes it missed"
            except redis.RedisError as exc:
                with self.lock:
                    if view:
                        self._missed, self._missed_args = None, 0  # written back at the next try
                    else:
                        self._put_back(calls[done:])
                return self._still_away(exc)

    def _still_away(self, exc: BaseException) -> bool:
        with self.lock:
            self.errors += 1
        log.debug("Redis fleet index still unreachable: %s", exc)
        return False

    def _back(self, how: str) -> bool:
        """In sync again: nothing is missed any more. Call with ``lock`` held."""
        self.in_sync = True
        self.dropped.clear()
        self._missed, self._missed_args = [], 0
        self.resyncs += 1
        log.warning("Redis fleet index %s", how)
        return True

    # ---- the sender thread: sends behind callers, reconnects off the request path ----------
    def _kick(self) -> None:
        """Wake the sender thread, started unless it runs (call with ``lock`` held)."""
        self._asked = True
        self._wake.set()
        if self._sender is None and not self._closed.is_set():
            self._sender = threading.Thread(
                target=self._send_behind, name="redis-index-sender", daemon=True
            )
            self._sender.start()

    def _send_behind(self) -> None:
        """Sends what callers left queued; while out of sync, every ``retry_interval`` a ping
        with the read timeout (no lock held, so a hung Redis holds nobody up) and, once Redis
        answers, the resync. Ends when nothing is left to do."""
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            with self.lock:
                if self._closed.is_set() or (self.in_sync and not self._asked):
                    self._sender = None
                    return
                self._asked = False
            if not self.in_sync:
                if time.monotonic() - self._last_try < self.retry_interval:
                    continue
                if self._locate is None:  # on a cluster the resync finds the node first
                    try:
                        self.reader().ping()
                    except Exception as exc:  # any failure: still away
                        with self.lock:
                            self._last_try = time.monotonic()
                        log.debug("Redis fleet index still unreachable: %s", exc)
                        continue
            self.flush(wait=False)

    # ---- internals ------------------------------------------------------------------------
    def _send(
        self, calls: list[ScriptCall], client: redis.Redis | None = None
    ) -> tuple[Any, list[Any]]:
        """``calls`` in one pipeline (on ``client``, by default the index's): the epoch and
        each call's result (``send_calls``)."""
        return send_calls(client or self.client, self.prefix, self.keys, calls)

    def _log_missed(self, calls: list[ScriptCall]) -> None:
        """``calls`` after the writes missed so far (call with ``lock`` held)."""
        if self._missed is None:
            return
        self._missed.extend(calls)
        self._count_missed(calls)

    def _put_back(self, calls: list[ScriptCall]) -> None:
        """``calls``, missed and not sent again, ahead of the writes missed since."""
        if self._missed is None:
            return
        self._missed[:0] = calls
        self._count_missed(calls)

    def _count_missed(self, calls: list[ScriptCall]) -> None:
        self._missed_args += sum(len(args) for _, args in calls)
        if self._missed_args > self.max_missed_args:  # the local view is written back instead
            self._missed, self._missed_args = None, 0

    def _moved(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the slot lives elsewhere now (Redis Cluster) and the node serving
        it was found: then the caller tries once more before counting a failure."""
        if self._locate is None or not isinstance(exc, redis.exceptions.MovedError):
            return False
        return self.relocate()
