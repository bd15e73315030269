"""The fleet index in Redis, shared by any number of router instances.

Key schema (``P`` is the key prefix, ``prefixcache:fleet`` by default; digests are the raw 16
bytes, replica names their UTF-8 text):

- ``P:replicas``   HASH   replica name -> slot number ``r`` (a small int, reused after a drop)
- ``P:slots``      STRING bitmap of slots in use (bit ``r`` set while a replica owns slot ``r``)
- ``P:b:<digest>`` STRING bitmap per block: bit ``2r`` set while replica ``r`` holds the block on
  GPU, bit ``2r + 1`` on CPU (Redis bit offsets: offset 0 is the high bit of the first byte);
  the key is deleted when no bit is left
- ``P:r:<name>``   SET    the digests replica ``name`` holds on any medium (its block count is
  the set's size; ``clear`` walks it)
- ``P:g:<name>``   STRING how many of them replica ``name`` holds on GPU (an integer; an index
  written before this key existed gets it counted from the set at the first call that needs it)
- ``P:e:<name>``   HASH   replica ``name``'s engine block hash -> the block's digest (16 bytes) and
  position (8 bytes, big-endian), emptied by ``clear``: what a router that joins the stream needs to
  map removals and continuations of blocks stored before it came (``SharedEngineMap``). Engine
  hashes are written ``i<decimal>`` for ints and ``b<bytes>`` for bytes (``h`` and a 128-bit
  digest of those longer than 64). A write-back after Redis lost its data restores it from the
  subscriber's own map (``attach_engine_source``).
- ``P:s:<name>``   STRING ``"<seq> <ts>"``: the last event batch of replica ``name`` a router
  applied (written at each flush, only ever by a newer batch: by timestamp, then number;
  deleted by ``drop_replica``): a router joining the stream replays the batches after it
- ``P:epoch``      STRING a random token naming the data: gone or changed once Redis lost it

Writes run as Lua scripts (one call per stored or removed run of blocks, the whole run as
arguments), queued and sent in pipelines of ``pipeline_size`` calls; ``flush()`` sends what is
queued, and every read flushes first. ``match`` is one round trip: ``GET`` of ``P:epoch``,
``MGET`` of the prompt's block keys and ``HGETALL`` of the replica table.

Redis Cluster (``redis+cluster://host:port``): the prefix must carry a hash tag (default
``{prefixcache:fleet}``) so that every key falls in one hash slot; the index talks to the node
serving that slot, finds it from any node of the cluster, and finds it again after a failure (a
failover or a resharding that moved the slot). The cluster gives availability, not sharding: one
node holds the whole index.

Failures: every write is also applied to a local ``MemoryFleetIndex`` (this instance's view).
When Redis fails (connection refused, reset, timeout), the error is counted, reads are answered
from the local view, the index is marked out of sync, and the writes Redis may have missed are
kept (up to ``max_missed_args`` arguments). The next call after ``retry_interval`` seconds
reconnects and resynchronises. If Redis kept its data (``P:epoch``, a random token set once,
is unchanged), the missed writes are sent again: every script is idempotent, and what other
routers wrote (blocks this instance never saw stored, engine maps) stays. If Redis lost its
data (a restart without persistence: the epoch is gone; also noticed at any flush or match),
the local view is added back (each router adds its own, a union: one that joined a stream
midway knows less), with the engine maps its subscriber keeps and the last applied batches,
in pipelines small enough to be answered within the socket timeout. If too many writes were
missed while Redis kept its data, each replica of the local view is cleared in Redis and
written back whole. Redis restored from an older snapshot keeps its epoch: that is not
noticed. An instance that only reads has an empty local view and answers no holdings while
Redis is away.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.fleet.fleet_index import CPU, GPU, AppliedBatch, EngineBlock, ReplicaMatch
from prefixcache.fleet.memory_index import (
    DEFAULT_MAX_BLOCKS_PER_REPLICA,
    DEFAULT_MAX_REPLICAS,
    MemoryFleetIndex,
    check_digests,
    check_medium,
    check_replica,
    match_masks,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "prefixcache:fleet"
DEFAULT_CLUSTER_PREFIX = "{prefixcache:fleet}"  # the hash tag puts every key in one slot
_REVERSE_BITS = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))
_CAP_ERROR = "prefixcache: max_replicas"

# Lua, with p, name, id and set bound: the replica's GPU counter exists from here on. An index
# written before the counter was kept has none: it is counted from the replica's set once.
_GPU_COUNTER = """
local gk = p .. ':g:' .. name
if redis.call('EXISTS', gk) == 0 then
  local held = 0
  for _, d in ipairs(redis.call('SMEMBERS', set)) do
    held = held + redis.call('GETBIT', p .. ':b:' .. d, 2 * id)
  end
  redis.call('SET', gk, held)
end
"""

# ARGV: prefix, replica, medium offset (0 GPU, 1 CPU), per-replica cap, max replicas, digests...
# Returns the number of blocks refused at the cap.
_STORE = (
    """
local p, name = ARGV[1], ARGV[2]
local off, cap, maxr = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local id = redis.call('HGET', p .. ':replicas', name)
if not id then
  if redis.call('HLEN', p .. ':replicas') >= maxr then
    return redis.error_reply('"""
    + _CAP_ERROR
    + """')
  end
  id = redis.call('BITPOS', p .. ':slots', 0)
  redis.call('SETBIT', p .. ':slots', id, 1)
  redis.call('HSET', p .. ':replicas', name, id)
end
id = tonumber(id)
local bit, other = 2 * id + off, 2 * id + 1 - off
local set = p .. ':r:' .. name
"""
    + _GPU_COUNTER
    + """
local n = redis.call('SCARD', set)
local added, refused = 0, 0
for i = 6, #ARGV do
  local k = p .. ':b:' .. ARGV[i]
  if redis.call('GETBIT', k, bit) == 0 then
    if redis.call('GETBIT', k, other) == 0 then
      if n >= cap then refused = #ARGV - i + 1 break end
      n = n + 1
      redis.call('SADD', set, ARGV[i])
    end
    redis.call('SETBIT', k, bit, 1)
    added = added + 1
  end
end
if off == 0 and added > 0 then redis.call('INCRBY', gk, added) end
return refused
"""
)

# ARGV: prefix, replica, mode (0 GPU, 1 CPU, 2 both), digests...
_REMOVE = (
    """
local p, name, mode = ARGV[1], ARGV[2], tonumber(ARGV[3])
local id = redis.call('HGET', p .. ':replicas', name)
if not id then return 0 end
id = tonumber(id)
local set = p .. ':r:' .. name
"""
    + _GPU_COUNTER
    + """
local gone = 0
for i = 4, #ARGV do
  local k = p .. ':b:' .. ARGV[i]
  if mode ~= 1 then gone = gone + redis.call('SETBIT', k, 2 * id, 0) end
  if mode ~= 0 then redis.call('SETBIT', k, 2 * id + 1, 0) end
  if redis.call('GETBIT', k, 2 * id) == 0 and redis.call('GETBIT', k, 2 * id + 1) == 0 then
    redis.call('SREM', set, ARGV[i])
  end
  if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
end
if gone > 0 then redis.call('DECRBY', gk, gone) end
return 0
"""
)

# ARGV: prefix, replica. The replica's GPU block count (0 for an unknown replica).
_GPU_COUNT = (
    """
local p, name = ARGV[1], ARGV[2]
local id = redis.call('HGET', p .. ':replicas', name)
if not id then return 0 end
id = tonumber(id)
local set = p .. ':r:' .. name
"""
    + _GPU_COUNTER
    + """
return tonumber(redis.call('GET', gk))
"""
)

# ARGV: prefix, replica, records (a known replica only). A record: the engine key's length (2
# bytes, big-endian), the key, then its value: digest (16 bytes), position (8 bytes).
_REMEMBER = """
local p, name, blob = ARGV[1], ARGV[2], ARGV[3]
if not redis.call('HGET', p .. ':replicas', name) then return 0 end
local e, i, n, fields = p .. ':e:' .. name, 1, #blob, {}
while i <= n do
  local a, b = string.byte(blob, i, i + 1)
  local j = i + 2 + a * 256 + b
  fields[#fields + 1] = string.sub(blob, i + 2, j - 1)
  fields[#fields + 1] = string.sub(blob, j, j + 23)
  i = j + 24
  if #fields >= 512 then redis.call('HSET', e, unpack(fields)) fields = {} end
end
if #fields > 0 then redis.call('HSET', e, unpack(fields)) end
return 0
"""

# ARGV: prefix, replica, engine keys...
_FORGET = """
local e = ARGV[1] .. ':e:' .. ARGV[2]
for i = 3, #ARGV, 512 do redis.call('HDEL', e, unpack(ARGV, i, math.min(i + 511, #ARGV))) end
return 0
"""

# ARGV: prefix, replica, engine keys... Per key: its value ('' when unknown) and the media bits
# of the block now (1 GPU, 2 CPU).
_RECALL = """
local p, name = ARGV[1], ARGV[2]
local id = redis.call('HGET', p .. ':replicas', name)
if not id then return {} end
id = tonumber(id)
local e, out = p .. ':e:' .. name, {}
for i = 3, #ARGV do
  local v = redis.call('HGET', e, ARGV[i])
  local media = 0
  if v then
    local k = p .. ':b:' .. string.sub(v, 1, 16)
    media = redis.call('GETBIT', k, 2 * id) + 2 * redis.call('GETBIT', k, 2 * id + 1)
  end
  out[#out + 1] = v or ''
  out[#out + 1] = media
end
return out
"""

# ARGV: prefix, replica, "seq ts", replica, "seq ts"... Only a newer batch (by its timestamp,
# then its number) replaces the one written: lagging routers and write-backs never go back.
_APPLIED = """
for i = 2, #ARGV, 2 do
  local k = ARGV[1] .. ':s:' .. ARGV[i]
  local seq, ts = string.match(ARGV[i + 1], '^(%S+) (%S+)$')
  local old = redis.call('GET', k)
  local newer = true
  if old then
    local oseq, ots = string.match(old, '^(%S+) (%S+)$')
    if ots then
      local a, b = tonumber(ts), tonumber(ots)
      newer = a > b or (a == b and tonumber(seq) >= tonumber(oseq))
    end
  end
  if newer then redis.call('SET', k, ARGV[i + 1]) end
end
return 0
"""

# ARGV: prefix, replica, drop (1: forget the replica too)
_CLEAR = """
local p, name, drop = ARGV[1], ARGV[2], ARGV[3]
local id = redis.call('HGET', p .. ':replicas', name)
if not id then return 0 end
id = tonumber(id)
local set = p .. ':r:' .. name
for _, d in ipairs(redis.call('SMEMBERS', set)) do
  local k = p .. ':b:' .. d
  redis.call('SETBIT', k, 2 * id, 0)
  redis.call('SETBIT', k, 2 * id + 1, 0)
  if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
end
redis.call('DEL', set, p .. ':g:' .. name, p .. ':e:' .. name)
if drop == '1' then
  redis.call('DEL', p .. ':s:' .. name)
  redis.call('HDEL', p .. ':replicas', name)
  redis.call('SETBIT', p .. ':slots', id, 0)
end
return 0
"""


class RedisIndexStats(NamedTuple):
    """What the Redis index has been through."""

    errors: int  # Redis calls that failed, and data losses noticed
    resyncs: int  # times brought back in sync (missed writes sent again, or the view written back)
    in_sync: bool  # False while Redis has missed writes
    overflow: int  # blocks refused at the per-replica cap (as Redis counted them)


class RedisFleetIndex:
    """``FleetIndex`` in Redis (see the module docstring for the key schema)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        pipeline_size: int = 256,
        retry_interval: float = 1.0,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        locate: Callable[[], redis.Redis] | None = None,
        max_missed_args: int = 1_000_000,
    ) -> None:
        """``locate`` (Redis Cluster) finds the client of the node serving the index's slot;
        it is called again before every resynchronisation."""
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"prefix must be a non-empty str, got {prefix!r}")
        if not isinstance(pipeline_size, int) or pipeline_size < 1:
            raise ConfigError(f"pipeline_size must be a positive int, got {pipeline_size!r}")
        if not isinstance(retry_interval, (int, float)) or retry_interval < 0:
            raise ConfigError(f"retry_interval must be >= 0, got {retry_interval!r}")
        if locate is not None and _hash_tag(prefix) is None:
            raise ConfigError(
                f"on Redis Cluster the prefix needs a {{hash tag}} so that every key shares one "
                f"slot, e.g. {DEFAULT_CLUSTER_PREFIX!r}; got {prefix!r}"
            )
        self.client = client
        self._locate = locate
        self._owner: _SlotOwner | None = None  # set by from_url on a cluster (closed with us)
        self.prefix = prefix
        self.pipeline_size = pipeline_size
        self.retry_interval = float(retry_interval)
        self.local = MemoryFleetIndex(
            max_replicas=max_replicas, max_blocks_per_replica=max_blocks_per_replica
        )
        self._store_script = client.register_script(_STORE)
        self._remove_script = client.register_script(_REMOVE)
        self._clear_script = client.register_script(_CLEAR)
        self._gpu_count_script = client.register_script(_GPU_COUNT)
        self._remember_script = client.register_script(_REMEMBER)
        self._forget_script = client.register_script(_FORGET)
        self._recall_script = client.register_script(_RECALL)
        self._applied_script = client.register_script(_APPLIED)
        self._applied: dict[str, str] = {}  # replica -> "seq ts" of the last batch applied
        self._applied_all: dict[str, str] = {}  # the same, written or not (for a write-back)
        self._queue: list[tuple[Any, list[Any]]] = []
        # writes Redis may lack since it failed (sent again when it is back with its data);
        # None: more than max_missed_args arguments, so the local view is written back instead
        self._missed: list[tuple[Any, list[Any]]] | None = []
        self._missed_args = 0
        self.max_missed_args = max_missed_args
        self._epoch: bytes | None = None  # the data's identity in Redis, as this instance saw it
        self._engine_source: Callable[[str], list[tuple[bytes, bytes, int]]] | None = None
        self._dropped: set[str] = set()  # replicas whose drop Redis may not have had yet
        self._lock = threading.RLock()
        self._in_sync = True
        self._last_try = 0.0
        self._errors = 0
        self._resyncs = 0
        self._overflow = 0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisFleetIndex:
        """An index on the Redis at ``url`` (``redis://host:port/db``, or
        ``redis+cluster://host:port`` for a Redis Cluster); short timeouts and no client-side
        retries, so a dead server is noticed at once and answered locally."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        cluster = scheme.endswith("+cluster")
        plain = urlunsplit(parts._replace(scheme=scheme.removesuffix("+cluster")))
        try:
            client = redis.Redis.from_url(plain, **_CLIENT_OPTIONS)
        except ValueError as exc:
            raise ConfigError(f"not a Redis URL: {url!r} ({exc})") from None
        if not cluster:
            return cls(client, **options)
        prefix = options.setdefault("prefix", DEFAULT_CLUSTER_PREFIX)
        owner = _SlotOwner(plain, f"{prefix}:replicas")
        index = cls(client, locate=owner.client, **options)
        index._owner = owner
        try:  # find the node now if the cluster answers; else at the first retry
            index.client = owner.client()
        except RedisClusterException as exc:
            if "cluster mode is not enabled" in str(exc).lower():
                client.close()
                raise ConfigError(
                    f"{url}: that Redis is not a cluster; use redis://host:port/db"
                ) from None
            index._failed(exc)
        except Exception as exc:  # unreachable now: answered locally, found at a retry
            index._failed(exc)
        else:
            client.close()
        return index

    # ---- FleetIndex -----------------------------------------------------------------------
    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """``replica`` now holds the blocks ``digests`` (16-byte digests) on ``medium``."""
        with self._lock:
            self.local.store(replica, digests, medium)  # validates; may raise the replica cap
            self._enqueue(self._store_script, self._store_args(replica, medium, digests))

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""
        with self._lock:
            self.local.remove(replica, digests, medium)
            if digests:
                mode = 2 if medium is None else int(medium == CPU)
                self._enqueue(self._remove_script, [self.prefix, replica, mode, *digests])

    def clear(self, replica: str) -> None:
        """``replica`` holds nothing any more (restart, ``AllBlocksCleared``); it stays known."""
        with self._lock:
            self.local.clear(replica)
            self._enqueue(self._clear_script, [self.prefix, replica, 0])

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (removed from the fleet)."""
        with self._lock:
            self.local.drop_replica(replica)
            self._applied.pop(replica, None)
            self._applied_all.pop(replica, None)
            self._dropped.add(replica)  # until sent: a failed send is mended by the resync
            self._enqueue(self._clear_script, [self.prefix, replica, 1])

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each known replica holds, one entry per replica
        (from the local view while Redis is unreachable)."""
        check_digests(digests)
        with self._lock:
            replies = self._read(lambda: self._match_replies(digests))
            if replies is not None:
                slots = {k.decode(): int(v) for k, v in replies[0].items()}
                values = replies[1] if digests else []
                masks = (
                    int.from_bytes(v.translate(_REVERSE_BITS), "little") if v else 0 for v in values
                )
                return match_masks(masks, len(digests), slots)
            return self.local.match(digests)

    def _match_replies(self, digests: Sequence[bytes]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.prefix + ":epoch")
        pipe.hgetall(self.prefix + ":replicas")
        if digests:
            pipe.mget([self.prefix.encode() + b":b:" + d for d in digests])
        epoch, *replies = pipe.execute()
        if self._epoch is not None and epoch != self._epoch:  # lost its data while idle
            self._lost_data()
            if self._try_resync():
                return self._match_replies(digests)
            raise redis.RedisError("Redis lost its data and the local view is not back yet")
        return replies

    def _lost_data(self) -> None:
        log.warning("Redis fleet index lost its data; writing the local view back")
        self._errors += 1
        self._in_sync, self._missed, self._last_try = False, None, 0.0

    def replicas(self) -> list[str]:
        """Every replica the index knows, sorted."""
        with self._lock:
            names = self._read(lambda: self.client.hkeys(self.prefix + ":replicas"))
            return self.local.replicas() if names is None else sorted(_text(n) for n in names)

    def num_blocks(self, replica: str) -> int:
        """Blocks (on any medium) the index holds for ``replica``."""
        check_replica(replica)
        with self._lock:
            n = self._read(lambda: self.client.scard(f"{self.prefix}:r:{replica}"))
            return self.local.num_blocks(replica) if n is None else int(n)

    def num_blocks_many(self, replicas: Sequence[str], medium: str | None = None) -> dict[str, int]:
        """Blocks held by each of ``replicas`` on ``medium`` (GPU or any medium: None), in one
        pipelined round trip."""
        for r in replicas:
            check_replica(r)
        if medium is not None and check_medium(medium) != GPU:
            raise InvalidArgumentError(f"medium must be {GPU!r} or None, got {medium!r}")
        if not replicas:
            return {}

        def counts() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            keys = [self.prefix + ":replicas"]
            for r in replicas:
                if medium is None:
                    pipe.scard(f"{self.prefix}:r:{r}")
                else:  # counted once from the set for an index without the counter
                    self._gpu_count_script(keys=keys, args=[self.prefix, r], client=pipe)
            return list(pipe.execute())

        with self._lock:
            got = self._read(counts)
            if got is None:
                return self.local.num_blocks_many(replicas, medium)
            return {r: max(0, int(n or 0)) for r, n in zip(replicas, got, strict=True)}

    # ---- SharedEngineMap -------------------------------------------------------------------
    def remember(
        self, replica: str, engine_keys: Sequence[bytes], digests: Sequence[bytes], position: int
    ) -> None:
        """``engine_keys[k]`` is the block ``digests[k]``, at ``position + k``."""
        if len(engine_keys) != len(digests):
            raise InvalidArgumentError(f"{len(engine_keys)} engine keys for {len(digests)} digests")
        if not digests:
            return
        if any(len(key) > 0xFFFF for key in engine_keys):
            raise InvalidArgumentError("engine keys must be at most 65,535 bytes")
        entries = [
            (key, digest, position + k)
            for k, (key, digest) in enumerate(zip(engine_keys, digests, strict=True))
        ]
        with self._lock:
            self._enqueue(self._remember_script, self._remember_args(replica, entries))

    def _remember_args(self, replica: str, entries: list[tuple[bytes, bytes, int]]) -> list[Any]:
        blob = b"".join(
            len(key).to_bytes(2, "big") + key + digest + pos.to_bytes(8, "big")
            for key, digest, pos in entries
        )  # one argument: packing a command costs per argument
        return [self.prefix, replica, blob]

    def forget(self, replica: str, engine_keys: Sequence[bytes]) -> None:
        """The replica holds these blocks nowhere any more."""
        if engine_keys:
            with self._lock:
                self._enqueue(self._forget_script, [self.prefix, replica, *engine_keys])

    def recall(self, replica: str, engine_keys: Sequence[bytes]) -> dict[bytes, EngineBlock] | None:
        """The remembered ones of ``engine_keys``, with where the replica holds each now (one
        round trip; None while Redis is unreachable)."""
        if not engine_keys:
            return {}
        with self._lock:
            reply = self._read(
                lambda: self._recall_script(
                    keys=[self.prefix + ":replicas"],
                    args=[self.prefix, replica, *engine_keys],
                    client=self.client,  # the node serving the slot now, not the first one
                )
            )
            if reply is None:
                return None
        out: dict[bytes, EngineBlock] = {}
        for key, value, media in zip(engine_keys, reply[::2], reply[1::2], strict=False):
            value = _raw(value)
            if len(value) == 24:
                out[key] = EngineBlock(value[:16], int.from_bytes(value[16:], "big"), int(media))
        return out

    def note_applied(self, replica: str, seq: int, ts: float) -> None:
        """The replica's event batches up to ``seq`` (stamped ``ts``) are applied (written at
        the next flush)."""
        with self._lock:
            self._applied[replica] = self._applied_all[replica] = f"{int(seq)} {float(ts)!r}"

    def last_applied(self, replica: str) -> AppliedBatch | None:
        """The last batch of the replica's stream a router applied (None: unknown, or Redis
        unreachable)."""
        with self._lock:
            value = self._read(lambda: self.client.get(f"{self.prefix}:s:{replica}") or b"")
        if not value:
            return None
        try:
            seq, ts = _text(value).split()
            return AppliedBatch(int(seq), float(ts))
        except ValueError:  # not written by this release
            return None

    def attach_engine_source(
        self, source: Callable[[str], list[tuple[bytes, bytes, int]]] | None
    ) -> None:
        """``source(replica)``: the (engine key, digest, position) of each block the caller
        knows ``replica`` holds; called to write engine maps back after Redis lost its data."""
        with self._lock:
            self._engine_source = source

    def _read(self, call: Callable[[], Any]) -> Any:
        """``call()`` after a flush, once more on a moved slot (Redis Cluster); None when Redis
        is away (the failure counted): the caller answers from the local view."""
        if not self.flush():
            return None
        try:
            return call()
        except redis.RedisError as exc:
            if self._moved(exc):
                with suppress(redis.RedisError):
                    return call()
            self._failed(exc)
            return None

    # ---- beyond the contract --------------------------------------------------------------
    def flush(self) -> bool:
        """Send the queued writes (resynchronising first if Redis missed some); True when Redis
        is in sync afterwards."""
        with self._lock:
            if not self._in_sync:
                return self._try_resync()
            if self._applied:  # one write per replica per flush, whatever the batches
                self._queue.append(self._applied_call(self._applied))
                self._applied.clear()
            if not self._queue:
                return True
            queue, self._queue = self._queue, []
            try:
                if self._epoch is None:
                    self._epoch = self._claim_epoch()
                epoch, results = self._send(queue)
                moved = next((r for r in results if isinstance(r, Exception)), None)
                if moved is not None and self._moved(moved):  # the writes are idempotent
                    epoch, results = self._send(queue)
            except redis.RedisError as exc:
                self._queue = queue + self._queue  # sent again once Redis is back
                self._failed(exc)
                return False
            for result in results:
                if isinstance(result, Exception):
                    if _CAP_ERROR in str(result):  # another instance filled the replica table
                        self._overflow += 1
                        continue
                    self._queue = queue + self._queue
                    self._failed(result)
                    return False
                self._overflow += int(result or 0)
            if epoch != self._epoch:  # Redis lost its data since the last flush (a restart)
                self._lost_data()
                return self._try_resync()
            self._dropped.clear()
            return True

    def _send(self, queue: list[tuple[Any, list[Any]]]) -> tuple[Any, list[Any]]:
        """Run queued script calls in one pipeline, after reading the data's epoch; per-call
        errors come back as results."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.prefix + ":epoch")
        keys = [self.prefix + ":replicas"]  # declared, so a cluster checks the slot up front
        for script, args in queue:
            script(keys=keys, args=args, client=pipe)
        epoch, *results = pipe.execute(raise_on_error=False)
        if isinstance(epoch, Exception):  # as any other call's error (a moved slot, say)
            return None, [epoch, *results]
        return epoch, results

    def _applied_call(self, applied: dict[str, str]) -> tuple[Any, list[Any]]:
        """The queued call that writes these last applied batches."""
        args: list[Any] = [self.prefix]
        for replica, value in applied.items():
            args += (replica, value)
        return self._applied_script, args

    def _claim_epoch(self) -> bytes:
        """The epoch of the data in Redis, set now if it has none (a fresh or emptied Redis)."""
        key = self.prefix + ":epoch"
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, uuid.uuid4().hex, nx=True)
        pipe.get(key)
        return _raw(pipe.execute()[1])

    def stats(self) -> RedisIndexStats:
        """Errors, resyncs, whether Redis is in sync, blocks refused at the cap."""
        return RedisIndexStats(self._errors, self._resyncs, self._in_sync, self._overflow)

    def holdings(self, replica: str) -> dict[bytes, frozenset[str]]:
        """Every digest ``replica`` holds in Redis and on which media (O(its blocks)); from the
        local view while Redis is unreachable."""
        check_replica(replica)
        with self._lock:
            if not self.flush():
                return self.local.holdings(replica)
            try:
                members = sorted(
                    _raw(m) for m in self.client.smembers(f"{self.prefix}:r:{replica}")
                )
                slot = self.client.hget(self.prefix + ":replicas", replica)
                if slot is None:
                    return {}
                r = int(slot)
                pipe = self.client.pipeline(transaction=False)
                for d in members:
                    key = self.prefix.encode() + b":b:" + d
                    pipe.getbit(key, 2 * r)
                    pipe.getbit(key, 2 * r + 1)
                bits = pipe.execute()
            except redis.RedisError as exc:
                self._failed(exc)
                return self.local.holdings(replica)
            return {
                d: frozenset(m for m, b in ((GPU, bits[2 * k]), (CPU, bits[2 * k + 1])) if b)
                for k, d in enumerate(members)
            }

    def close(self) -> None:
        """Send what is queued (if Redis is there) and close the connections."""
        with self._lock:
            self.flush()
            self.client.close()
            if self._owner is not None:
                self._owner.close()

    # ---- internals ------------------------------------------------------------------------
    def _store_args(self, replica: str, medium: str, digests: Sequence[bytes]) -> list[Any]:
        cap, maxr = self.local.max_blocks_per_replica, self.local.max_replicas
        return [self.prefix, replica, int(medium == CPU), cap, maxr, *digests]

    def _enqueue(self, script: Any, args: list[Any]) -> None:
        if not self._in_sync:
            self._log_missed([(script, args)])  # sent when Redis is back
            return
        self._queue.append((script, args))
        if len(self._queue) >= self.pipeline_size:
            self.flush()

    def _log_missed(self, calls: list[tuple[Any, list[Any]]]) -> None:
        if self._missed is None:
            return
        self._missed_args += sum(len(args) for _, args in calls)
        if self._missed_args > self.max_missed_args:  # the local view is written back instead
            self._missed, self._missed_args = None, 0
        else:
            self._missed.extend(calls)

    def _failed(self, exc: BaseException) -> None:
        self._errors += 1
        if self._in_sync:
            log.warning("Redis fleet index unreachable (%s); answering from the local view", exc)
        self._in_sync = False
        self._log_missed(self._queue)
        self._queue = []
        self._last_try = time.monotonic()

    def _relocate(self) -> bool:
        """Point the client at the node serving the index's slot (Redis Cluster); False, and
        counted as a failure, when the cluster cannot say."""
        if self._locate is None:
            return True
        try:
            client = self._locate()
        except Exception as exc:  # any failure to ask the cluster counts as Redis being away
            self._failed(exc)
            return False
        if client is not self.client:
            self.client.close()
            self.client = client
        return True

    def _moved(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the slot lives elsewhere now (Redis Cluster) and the node serving
        it was found: then the caller tries once more before counting a failure."""
        if self._locate is None or not isinstance(exc, redis.exceptions.MovedError):
            return False
        return self._relocate()

    def _send_missed(self, missed: list[tuple[Any, list[Any]]]) -> bool:
        """Redis is back with its data: send the writes it missed (idempotent scripts)."""
        try:
            for i in range(0, len(missed), 1024):
                epoch, results = self._send(missed[i : i + 1024])
                for result in results:
                    if isinstance(result, Exception) and _CAP_ERROR not in str(result):
                        raise result
                if epoch != self._epoch:
                    raise redis.RedisError("the data changed while the missed writes were sent")
        except redis.RedisError as exc:
            return self._still_away(exc)
        return self._back(f"back with its data; sent the {len(missed)} writes it missed")

    def _try_resync(self) -> bool:
        now = time.monotonic()
        if now - self._last_try < self.retry_interval:
            return False
        self._last_try = now
        if not self._relocate():
            return False
        try:
            self.client.ping()
            epoch = self.client.get(self.prefix + ":epoch")
            missed = self._missed
            # Redis kept its data: the epoch this instance saw, or any when it never saw one
            kept = None if epoch is None or self._epoch not in (None, _raw(epoch)) else _raw(epoch)
            if kept is not None and missed is not None:
                self._epoch = kept
                return self._send_missed(missed)
            # Redis lost its data, or too many writes were missed: the local view goes back.
            # Added, not put in place, after a loss: another router's view (blocks this one
            # never saw stored) may be there already
            calls: list[tuple[Any, list[Any]]] = []
            for replica in sorted(self._dropped):  # dropped while Redis was away
                calls.append((self._clear_script, [self.prefix, replica, 1]))
            for replica in self.local.replicas():
                if kept is not None:  # behind on writes Redis had: what it removed must go
                    calls.append((self._clear_script, [self.prefix, replica, 0]))
                by_medium: dict[str, list[bytes]] = {GPU: [], CPU: []}
                for d, media in self.local.holdings(replica).items():
                    for m in media:
                        by_medium[m].append(d)
                for medium, digests in by_medium.items():
                    for i in range(0, len(digests), 1024):
                        chunk = digests[i : i + 1024]
                        calls.append((self._store_script, self._store_args(replica, medium, chunk)))
                if self._engine_source is not None:  # and the engine map, as the caller knows it
                    entries = self._engine_source(replica)
                    for i in range(0, len(entries), 1024):
                        calls.append(
                            (
                                self._remember_script,
                                self._remember_args(replica, entries[i : i + 1024]),
                            )
                        )
            if self._applied_all:
                calls.append(self._applied_call(self._applied_all))
            keys = [self.prefix + ":replicas"]
            for i in range(0, len(calls), 16):  # pipelines Redis answers within the timeout
                pipe = self.client.pipeline(transaction=False)
                for script, script_args in calls[i : i + 16]:
                    script(keys=keys, args=script_args, client=pipe)
                pipe.execute()
            self._epoch = self._claim_epoch()
        except redis.RedisError as exc:
            return self._still_away(exc)
        return self._back(f"back; wrote the local view of {len(self.local.replicas())} replicas")

    def _still_away(self, exc: BaseException) -> bool:
        self._errors += 1
        log.debug("Redis fleet index still unreachable: %s", exc)
        return False

    def _back(self, how: str) -> bool:
        """In sync again: nothing is missed any more."""
        self._in_sync = True
        self._dropped.clear()
        self._missed, self._missed_args = [], 0
        self._resyncs += 1
        log.warning("Redis fleet index %s", how)
        return True


_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 1.0,
    "retry": Retry(NoBackoff(), 0),
}


class _SlotOwner:
    """Finds the node of a Redis Cluster that serves one key's slot (every key of the index).

    The cluster client is kept once it reached the cluster, so its list of nodes (every node it
    saw, not just the one in the URL) seeds the next search: a failover of the URL's node is
    followed too."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key
        self._cluster: RedisCluster | None = None

    def client(self) -> redis.Redis:
        """A client of the node serving the key's slot now (the cluster asked afresh)."""
        if self._cluster is None:
            self._cluster = RedisCluster.from_url(self.url, **_CLIENT_OPTIONS)
        else:
            self._cluster.nodes_manager.initialize()
        node = self._cluster.get_node_from_key(self.key)
        if node is None:
            raise RedisClusterException(f"no node serves the slot of {self.key!r}")
        return redis.Redis.from_url(_node_url(self.url, node.host, node.port), **_CLIENT_OPTIONS)

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def _node_url(url: str, host: str, port: int) -> str:
    """``url`` (scheme, credentials, options) pointed at one node, database 0."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
    return urlunsplit(
        parts._replace(netloc=f"{userinfo}@{address}" if userinfo else address, path="")
    )


def _hash_tag(prefix: str) -> str | None:
    """The hash tag of a key prefix (``{...}``, non-empty), as Redis Cluster reads it."""
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start >= 0 else -1
    return prefix[start + 1 : end] if end > start + 1 else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
