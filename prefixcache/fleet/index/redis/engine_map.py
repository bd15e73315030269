"""The shared engine map in Redis: each replica's engine block hash -> block (``P:e:<name>``) and
the last event batch a router applied (``P:s:<name>``), see ``scripts`` for the keys.

A router that joins a replica's stream midway (a restart, a new instance) reads them to replay
only the batches the index missed and to map removals and continuations of blocks stored before
it came. Writes go through the index's ``RedisSync``: queued with the index's own writes, the last
applied batches written once per flush, and both written back after Redis lost its data.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, cast

from prefixcache.errors import FleetCapacityError, InvalidArgumentError
from prefixcache.fleet.index.interface import AppliedBatch, EngineBlock
from prefixcache.fleet.index.redis.script_calls import EngineSource
from prefixcache.fleet.index.redis.scripts import as_bytes, as_text, remember_args
from prefixcache.fleet.index.redis.sync import RedisSync
from prefixcache.medium import CPU, GPU

if TYPE_CHECKING:
    import redis

ADOPT_CHUNK = 1000  # engine map entries read per round trip when a router adopts a replica


class RedisEngineMap:
    """``SharedEngineMap`` over a ``RedisSync`` (the Redis index is one)."""

    def __init__(self, sync: RedisSync) -> None:
        self.sync = sync

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
        sync = self.sync
        with sync.lock:
            sync.enqueue(sync.scripts.remember, remember_args(sync.prefix, replica, entries))

    def forget(self, replica: str, engine_keys: Sequence[bytes]) -> None:
        """The replica holds these blocks nowhere any more."""
        if engine_keys:
            sync = self.sync
            with sync.lock:
                sync.enqueue(sync.scripts.forget, [sync.prefix, replica, *engine_keys])

    def recall(self, replica: str, engine_keys: Sequence[bytes]) -> dict[bytes, EngineBlock] | None:
        """The remembered ones of ``engine_keys``, with where the replica holds each now (one
        round trip; None while Redis is unreachable). The blocks it still holds join the local
        view: this instance follows them from now on, and writes them back if Redis loses its
        data."""
        if not engine_keys:
            return {}
        sync = self.sync
        out: dict[bytes, EngineBlock] = {}
        reply = sync.read(
            lambda client: sync.scripts.recall(
                keys=sync.keys,
                args=[sync.prefix, replica, *engine_keys],
                client=client,  # the node serving the slot now, not the first one
            )
        )
        if reply is None:
            return None
        for key, value, media in zip(engine_keys, reply[::2], reply[1::2], strict=False):
            block = _engine_block(as_bytes(value), int(media))
            if block is not None:
                out[key] = block
        with sync.lock:
            self._join_local_view(replica, out.values())
        return out

    def adopt(self, replica: str, limit: int | None = None) -> dict[bytes, EngineBlock] | None:
        """Every block the map remembers for ``replica`` that the replica still holds, by
        engine key (at most ``limit``; O(its blocks): one scan step and one pipelined read per
        ``ADOPT_CHUNK`` entries, each a read of its own, so routes and writes go on between
        them). They join the local view, as recalled blocks do, so a router that joins a stream
        answers from a whole view while Redis is away later. None when Redis is unreachable at
        the start; the blocks read so far when it fails midway."""
        sync = self.sync
        prefix = sync.prefix
        slot = sync.read(lambda client: [client.hget(f"{prefix}:replicas", replica)])
        if slot is None:
            return None
        out: dict[bytes, EngineBlock] = {}
        if slot[0] is None:
            return out
        r = int(slot[0])

        def step(client: redis.Redis, cursor: int) -> tuple[int, dict[bytes, EngineBlock]]:
            cursor, chunk = client.hscan(f"{prefix}:e:{replica}", cursor, count=ADOPT_CHUNK)
            entries = cast("dict[Any, Any]", chunk)  # redis-py parses HSCAN into a dict
            items = [(as_bytes(k), as_bytes(v)) for k, v in entries.items()]
            items = [(k, v) for k, v in items if len(v) == 24]
            found: dict[bytes, EngineBlock] = {}
            if items:
                pipe = client.pipeline(transaction=False)
                blocks = prefix.encode() + b":b:"
                for _, v in items:
                    pipe.getbit(blocks + v[:16], 2 * r)
                    pipe.getbit(blocks + v[:16], 2 * r + 1)
                bits = pipe.execute()
                for k, (key, v) in enumerate(items):
                    block = _engine_block(v, int(bits[2 * k]) + 2 * int(bits[2 * k + 1]))
                    if block is not None and block.media:
                        found[key] = block
            return int(cursor), found

        cursor = 0
        while limit is None or len(out) < limit:
            got = sync.read(functools.partial(step, cursor=cursor))  # a read per step
            if got is None:
                break  # Redis went away: what was read stands, the rest is recalled later
            cursor, found = got
            if limit is not None:
                found = dict(list(found.items())[: limit - len(out)])
            with sync.lock:
                self._join_local_view(replica, found.values())
            out.update(found)
            if not cursor:
                break
        return out

    def _join_local_view(self, replica: str, blocks: Iterable[EngineBlock]) -> None:
        """Blocks the replica holds, read from Redis, into the local view. Call with the lock."""
        held: dict[str, list[bytes]] = {GPU: [], CPU: []}
        for block in blocks:
            for bit, medium in ((1, GPU), (2, CPU)):
                if block.media & bit:
                    held[medium].append(block.digest)
        for medium, digests in held.items():
            if digests:
                with suppress(FleetCapacityError):  # the view is full: Redis keeps them
                    self.sync.local.store(replica, digests, medium)

    def note_applied(self, replica: str, seq: int, ts: float) -> None:
        """The replica's event batches up to ``seq`` (stamped ``ts``) are applied (written at
        the next flush)."""
        sync = self.sync
        with sync.lock:
            sync.applied[replica] = sync.applied_all[replica] = f"{int(seq)} {float(ts)!r}"

    def last_applied(self, replica: str) -> AppliedBatch | None:
        """The last batch of the replica's stream a router applied (None: unknown, or Redis
        unreachable)."""
        sync = self.sync
        value = sync.read(lambda c: c.get(f"{sync.prefix}:s:{replica}") or b"")
        if not value:
            return None
        try:
            seq, ts = as_text(value).split()
            return AppliedBatch(int(seq), float(ts))
        except ValueError:  # not written by this release
            return None

    def attach_engine_source(self, source: EngineSource | None) -> None:
        """``source(replica)``: the (engine key, digest, position) of each block the caller
        knows ``replica`` holds; called to write engine maps back after Redis lost its data."""
        with self.sync.lock:
            self.sync.engine_source = source


def _engine_block(value: bytes, media: int) -> EngineBlock | None:
    """An engine map entry (16-byte digest, 8-byte big-endian position) and the media the
    replica holds it on; None for a value this release does not write."""
    if len(value) != 24:
        return None
    return EngineBlock(value[:16], int.from_bytes(value[16:], "big"), media)
