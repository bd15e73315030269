"""The fleet index in Redis, shared by any number of router instances.

The keys and the Lua scripts that write them are in ``scripts``; the write queue, outages
and resyncs in ``sync``; the shared engine map (engine hash -> block, last applied batch)
in ``engine_map``; connecting, and a Redis Cluster's slot owner, in ``connect``.

Writes are queued script calls, one per stored or removed run of blocks, applied to a local
``MemoryFleetIndex`` as well (this instance's view, answered from while Redis is away).
``match`` is one round trip: ``GET`` of ``P:epoch``, ``MGET`` of the prompt's block keys and
``HGETALL`` of the replica table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.fleet.index.interface import ReplicaMatch
from prefixcache.fleet.index.memory import (
    DEFAULT_MAX_BLOCKS_PER_REPLICA,
    DEFAULT_MAX_REPLICAS,
    MemoryFleetIndex,
    check_digests,
    check_medium,
    check_replica,
    match_masks,
)
from prefixcache.fleet.index.redis.connect import (
    DEFAULT_CLUSTER_PREFIX,
    DEFAULT_PREFIX,
    ClusterSlotOwner,
    check_cluster_prefix,
    not_a_cluster,
    open_client,
    parse_index_url,
)
from prefixcache.fleet.index.redis.engine_map import RedisEngineMap
from prefixcache.fleet.index.redis.scripts import (
    REVERSED_BITS,
    as_bytes,
    as_text,
    register_scripts,
    store_args,
)
from prefixcache.fleet.index.redis.sync import DEFAULT_READ_TIMEOUT, RedisIndexStats, RedisSync
from prefixcache.fleet.index.url_checks import (
    check_index_prefix,
    is_cluster_url,
    redact,
    split_prefix,
)
from prefixcache.medium import CPU, GPU


class RedisFleetIndex(RedisEngineMap):
    """``FleetIndex`` in Redis (see ``scripts`` for the key schema), and the
    ``SharedEngineMap`` of the replicas it indexes."""

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
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        """``locate`` (Redis Cluster) finds the client of the node serving the index's slot;
        it is called again before every resynchronisation. A read not answered within
        ``read_timeout`` seconds is answered from the local view."""
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"prefix must be a non-empty str, got {prefix!r}")
        if not isinstance(pipeline_size, int) or pipeline_size < 1:
            raise ConfigError(f"pipeline_size must be a positive int, got {pipeline_size!r}")
        if not isinstance(retry_interval, (int, float)) or retry_interval < 0:
            raise ConfigError(f"retry_interval must be >= 0, got {retry_interval!r}")
        if (
            isinstance(read_timeout, bool)
            or not isinstance(read_timeout, (int, float))
            or not 0 < read_timeout < 3600
        ):
            raise ConfigError(f"read_timeout must be in (0, 3600) seconds, got {read_timeout!r}")
        if locate is not None:
            check_cluster_prefix(prefix)
        self.prefix = prefix
        self.local = MemoryFleetIndex(
            max_replicas=max_replicas, max_blocks_per_replica=max_blocks_per_replica
        )
        super().__init__(
            RedisSync(
                client,
                prefix=prefix,
                scripts=register_scripts(client),
                local=self.local,
                pipeline_size=pipeline_size,
                retry_interval=float(retry_interval),
                max_missed_args=max_missed_args,
                locate=locate,
                read_timeout=float(read_timeout),
            )
        )
        self._owner: ClusterSlotOwner | None = None  # set by from_url on a cluster

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisFleetIndex:
        """An index on the Redis at ``url`` (``redis://host:port/db``, or
        ``redis+cluster://host:port`` for a Redis Cluster); short timeouts and no client-side
        retries, so a dead server is noticed at once and answered locally. The URL's
        ``?prefix=`` is the key prefix (ConfigError if ``options`` name another)."""
        url, in_url = split_prefix(url)
        if in_url is not None:
            check_index_prefix(in_url, "?prefix", cluster=is_cluster_url(url))
            if options.setdefault("prefix", in_url) != in_url:
                raise ConfigError(
                    f"two key prefixes for one index: {in_url!r} in the URL and "
                    f"{options['prefix']!r}; give one"
                )
        target = parse_index_url(url)
        client = open_client(target.url, url)
        if not target.cluster:
            return cls(client, **options)
        prefix = options.setdefault("prefix", DEFAULT_CLUSTER_PREFIX)
        owner = ClusterSlotOwner(target.url, f"{prefix}:replicas")
        index = cls(client, locate=owner.client, **options)
        index._owner = owner
        try:  # find the node now if the cluster answers; else at the first retry
            index.sync.client = owner.client()
        except Exception as exc:  # unreachable now: answered locally, found at a retry
            if not_a_cluster(exc):
                client.close()
                raise ConfigError(
                    f"{redact(url)}: that Redis is not a cluster; use redis://host:port/db"
                ) from None
            index.sync.failed(exc)
        else:
            client.close()
        return index

    @property
    def client(self) -> redis.Redis:
        """The client of the Redis the index talks to now (on a cluster, of the node serving
        the index's slot)."""
        return self.sync.client

    @property
    def retry_interval(self) -> float:
        """Seconds between tries to reach Redis again while it is away."""
        return self.sync.retry_interval

    @retry_interval.setter
    def retry_interval(self, seconds: float) -> None:
        self.sync.retry_interval = seconds

    # ---- FleetIndex -----------------------------------------------------------------------
    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """``replica`` now holds the blocks ``digests`` (16-byte digests) on ``medium``."""
        sync, local = self.sync, self.local
        with sync.lock:
            local.store(replica, digests, medium)  # validates; may raise the replica cap
            args = store_args(
                self.prefix,
                replica,
                medium,
                digests,
                local.max_blocks_per_replica,
                local.max_replicas,
            )
            sync.enqueue(sync.scripts.store, args)

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""
        sync = self.sync
        with sync.lock:
            self.local.remove(replica, digests, medium)
            if digests:
                mode = 2 if medium is None else int(medium == CPU)
                sync.enqueue(sync.scripts.remove, [self.prefix, replica, mode, *digests])

    def clear(self, replica: str) -> None:
        """``replica`` holds nothing any more (restart, ``AllBlocksCleared``); it stays known."""
        sync = self.sync
        with sync.lock:
            self.local.clear(replica)
            sync.enqueue(sync.scripts.clear, [self.prefix, replica, 0])

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (removed from the fleet)."""
        sync = self.sync
        with sync.lock:
            self.local.drop_replica(replica)
            sync.applied.pop(replica, None)
            sync.applied_all.pop(replica, None)
            sync.dropped.add(replica)  # until sent: a failed send is mended by the resync
            sync.enqueue(sync.scripts.clear, [self.prefix, replica, 1])

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each known replica holds, one entry per replica
        (from the local view while Redis is unreachable)."""
        check_digests(digests)
        replies = self.sync.read(lambda c: self._match_replies(c, digests), request=True)
        if replies is not None:
            slots = {k.decode(): int(v) for k, v in replies[0].items()}
            values = replies[1] if digests else []
            masks = (
                int.from_bytes(v.translate(REVERSED_BITS), "little") if v else 0 for v in values
            )
            return match_masks(masks, len(digests), slots)
        return self.local.match(digests)  # safe beside the writer without the lock

    def _match_replies(self, client: redis.Redis, digests: Sequence[bytes]) -> list[Any] | None:
        sync = self.sync
        pipe = client.pipeline(transaction=False)
        pipe.get(self.prefix + ":epoch")
        pipe.hgetall(self.prefix + ":replicas")
        if digests:
            pipe.mget([self.prefix.encode() + b":b:" + d for d in digests])
        epoch, *replies = pipe.execute()
        if sync.epoch is not None and epoch != sync.epoch:  # lost its data while idle
            sync.lost_data()  # the sender thread writes the local view back
            return None  # answered from the local view meanwhile
        return replies

    def replicas(self) -> list[str]:
        """Every replica the index knows, sorted."""
        names = self.sync.read(lambda c: c.hkeys(self.prefix + ":replicas"), request=True)
        return self.local.replicas() if names is None else sorted(as_text(n) for n in names)

    def num_blocks(self, replica: str) -> int:
        """Blocks (on any medium) the index holds for ``replica``."""
        check_replica(replica)
        n = self.sync.read(lambda c: c.scard(f"{self.prefix}:r:{replica}"), request=True)
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
        sync = self.sync

        def counts(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for r in replicas:
                if medium is None:
                    pipe.scard(f"{self.prefix}:r:{r}")
                else:  # counted once from the set for an index without the counter
                    sync.scripts.gpu_count(keys=sync.keys, args=[self.prefix, r], client=pipe)
            return list(pipe.execute())

        got = sync.read(counts, request=True)
        if got is None:
            return self.local.num_blocks_many(replicas, medium)
        return {r: max(0, int(n or 0)) for r, n in zip(replicas, got, strict=True)}

    # ---- beyond the contract --------------------------------------------------------------
    def flush(self) -> bool:
        """Send the queued writes (resynchronising first if Redis missed some); True when Redis
        is in sync afterwards."""
        return self.sync.flush()

    def stats(self) -> RedisIndexStats:
        """Errors, resyncs, whether Redis is in sync, blocks refused at the cap."""
        return self.sync.stats()

    def holdings(self, replica: str) -> dict[bytes, frozenset[str]]:
        """Every digest ``replica`` holds in Redis and on which media (O(its blocks)); from the
        local view while Redis is unreachable."""
        check_replica(replica)
        sync = self.sync
        if not sync.flush():
            return self.local.holdings(replica)
        try:
            client = sync.client
            members = sorted(as_bytes(m) for m in client.smembers(f"{self.prefix}:r:{replica}"))
            slot = client.hget(self.prefix + ":replicas", replica)
            if slot is None:
                return {}
            r = int(slot)
            pipe = client.pipeline(transaction=False)
            for d in members:
                key = self.prefix.encode() + b":b:" + d
                pipe.getbit(key, 2 * r)
                pipe.getbit(key, 2 * r + 1)
            bits = pipe.execute()
        except redis.RedisError as exc:
            sync.failed(exc)
            return self.local.holdings(replica)
        return {
            d: frozenset(m for m, b in ((GPU, bits[2 * k]), (CPU, bits[2 * k + 1])) if b)
            for k, d in enumerate(members)
        }

    def send_queued(self) -> None:
        """Send the queued writes unless another thread is sending (they go with its send, or
        right after it); never waits on Redis while one is under way."""
        self.sync.flush(wait=False)

    def close(self) -> None:
        """Send what is queued (if Redis is there) and close the connections."""
        self.sync.close()
        if self._owner is not None:
            self._owner.close()
