"""The Redis fleet index's key layout, and the Lua scripts that write and read it.

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

Writes run as the Lua scripts below, one call per stored or removed run of blocks with the whole
run as arguments. Every script is idempotent, so a write sent twice (again after an outage)
leaves what it left the first time. A queued call is a pair (script, arguments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from prefixcache.medium import CPU

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script

# the error a store answers when the replica table is full (another instance filled it)
CAP_ERROR = "prefixcache: max_replicas"
# a block bitmap's bytes with their bits reversed: bit 2r of the bitmap becomes bit 2r of an int
REVERSED_BITS = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))

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
    + CAP_ERROR
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


class IndexScripts(NamedTuple):
    """The index's scripts, registered once; each runs on any client or pipeline passed to it
    (its SHA is the same on every node)."""

    store: Script
    remove: Script
    clear: Script
    gpu_count: Script
    remember: Script
    forget: Script
    recall: Script
    applied: Script


def register_scripts(client: redis.Redis) -> IndexScripts:
    """The index's scripts, registered with ``client``."""
    return IndexScripts(
        store=client.register_script(_STORE),
        remove=client.register_script(_REMOVE),
        clear=client.register_script(_CLEAR),
        gpu_count=client.register_script(_GPU_COUNT),
        remember=client.register_script(_REMEMBER),
        forget=client.register_script(_FORGET),
        recall=client.register_script(_RECALL),
        applied=client.register_script(_APPLIED),
    )


def store_args(
    prefix: str,
    replica: str,
    medium: str,
    digests: Sequence[bytes],
    max_blocks_per_replica: int,
    max_replicas: int,
) -> list[Any]:
    """The arguments of a store of ``digests`` on ``medium``."""
    return [prefix, replica, int(medium == CPU), max_blocks_per_replica, max_replicas, *digests]


def remember_args(
    prefix: str, replica: str, entries: Sequence[tuple[bytes, bytes, int]]
) -> list[Any]:
    """The arguments of a write of engine map ``entries``, each (engine key, digest, position),
    packed in one argument: packing a command costs per argument."""
    blob = b"".join(
        len(key).to_bytes(2, "big") + key + digest + pos.to_bytes(8, "big")
        for key, digest, pos in entries
    )
    return [prefix, replica, blob]


def applied_args(prefix: str, applied: Mapping[str, str]) -> list[Any]:
    """The arguments of a write of the last applied batches, replica -> ``"seq ts"``."""
    args: list[Any] = [prefix]
    for replica, value in applied.items():
        args += (replica, value)
    return args


def as_bytes(value: bytes | str) -> bytes:
    """A reply's value as bytes."""
    return value if isinstance(value, bytes) else value.encode()


def as_text(value: bytes | str) -> str:
    """A reply's value as text."""
    return value.decode() if isinstance(value, bytes) else value
