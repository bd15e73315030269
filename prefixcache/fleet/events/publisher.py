"""Publish a CacheManager's block events on ZMQ, as vLLM's ``ZmqEventPublisher`` does.

The publisher listens to a manager, turns each event into a wire event (``wire``) and keeps
them until ``flush()``, which a runtime calls after ``end_step()``: one batch per flush, sent on a
PUB socket as ``(topic, seq, payload)`` with ``seq`` counting from 0, and kept in a bounded
replay buffer. A ROUTER socket (optional) answers replay requests, ``(identity, b"", start seq as
8 big-endian bytes)``, as vLLM's does: ``(identity, b"", topic, seq, payload)`` for every
buffered batch from ``start`` on, then ``(identity, b"", b"", END_SEQ, b"")``; a thread serves
it.

How prefixcache's events map onto the wire, as vLLM 0.33 fills its fields: block hashes are the
16-byte digests; ``medium`` is the event's (``prefixcache.medium``: ``GPU``, ``CPU`` for the host
tier, ``STORE`` for a shared store); ``lora_name`` is the namespace's adapter and ``lora_id`` a
stable positive int derived from it (``adapter_id``); ``extra_keys`` is what vLLM's
``to_event_extra_keys`` makes of ``generate_block_hash_extra_keys`` for a text prompt, one entry
per block: the adapter name, then, on the block that starts at token 0 (the first of a chain,
``parent_block_hash`` None), the salt as vLLM's ``cache_salt`` (when not empty); a block with no
keys has None, and an event none of whose blocks has keys has ``extra_keys`` None. Nothing else
goes there: the rest of the namespace (``adapter_version``, ``extra``), which vLLM has no key for,
is in the block hashes themselves (prefixcache's digests are seeded by the whole namespace), and a
subscriber takes it from the replica's configuration (``ReplicaEndpoint.namespace``). Two
differences remain, both read alike by vLLM's decoder and its consumers: a run none of whose blocks
has keys sends ``extra_keys`` None, where vLLM 0.33 sends None per block, and ``group_idx`` is left
out (the main group), where vLLM 0.33 sends 0.

The batch goes out in ``WireLayout.MAP_EVENTS``, the layout vLLM 0.33's decoder reads; the
older layouts are read by the subscriber but never sent (``layout`` takes no other value).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import suppress
from typing import Any

import xxhash
import zmq

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import (
    ConfigError,
    InvalidArgumentError,
    PrefixCacheError,
    WireFormatError,
)
from prefixcache.fleet.events.wire import (
    END_SEQ,
    KVEventBatch,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    WireLayout,
    decode_seq,
    encode_batch,
    encode_seq,
)
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from prefixcache.manager.cache_manager import CacheManager

log = logging.getLogger(__name__)


class PublisherClosedError(PrefixCacheError, RuntimeError):
    """The publisher was closed."""


def adapter_id(adapter: str) -> int:
    """The ``lora_id`` sent for ``adapter``: a stable int in 1 .. 2**31 - 1."""
    return xxhash.xxh32_intdigest(adapter.encode("utf-8")) % 0x7FFFFFFF + 1


def block_extra_keys(
    namespace: Namespace, n_blocks: int, chain_start: bool
) -> list[tuple[Any, ...] | None] | None:
    """``extra_keys`` of a run of ``n_blocks`` blocks as vLLM 0.33 sends it: per block the
    adapter name, then on the block at token 0 (``chain_start``) the salt, when not empty."""
    every: tuple[Any, ...] = () if namespace.adapter is None else (namespace.adapter,)
    first = every
    if chain_start and namespace.salt:  # vLLM: ``if start_token_idx == 0 and cache_salt``
        first += (namespace.salt,)
    if not n_blocks or not first:  # ``first`` holds every key ``every`` does
        return None
    rest = every or None
    return [first] + [rest] * (n_blocks - 1)


def to_wire(event: CacheEvent) -> WireEvent:
    """The wire event for one of the manager's events."""
    if isinstance(event, BlockStored):
        adapter = event.namespace.adapter
        return WireBlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None if adapter is None else adapter_id(adapter),
            medium=event.medium,
            lora_name=adapter,
            extra_keys=block_extra_keys(
                event.namespace, len(event.block_hashes), event.parent_block_hash is None
            ),
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)
    if isinstance(event, AllBlocksCleared):
        return WireAllBlocksCleared()
    raise TypeError(f"not a cache event: {event!r}")


class KVEventPublisher:
    """PUB socket for batches, bounded replay buffer, ROUTER socket for replays.

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://127.0.0.1:*`` picks a free port;
    ``endpoint`` / ``replay_endpoint`` attributes then hold the bound addresses)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
        layout: WireLayout = WireLayout.MAP_EVENTS,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be a positive int, got {buffer_steps!r}")
        if layout is not WireLayout.MAP_EVENTS:
            raise ConfigError(
                f"layout must be WireLayout.MAP_EVENTS, the layout vLLM 0.33's decoder reads, "
                f"got {layout!r}: the older layouts are read by the subscriber, never sent"
            )
        self.topic = topic.encode("utf-8")
        self.layout = layout
        self.data_parallel_rank = data_parallel_rank
        self._ctx = context or zmq.Context.instance()
        self._pending: list[WireEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self._managers: list[CacheManager] = []
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as exc:
            self._pub.close()
            raise ConfigError(f"cannot bind the event endpoint {endpoint!r}: {exc}") from None
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._router: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError as exc:
                router.close()
                self._pub.close()
                raise ConfigError(
                    f"cannot bind the replay endpoint {replay_endpoint!r}: {exc}"
                ) from None
            self._router = router
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replays, name="kv-replay", daemon=True
            )
            self._thread.start()

    def attach(self, manager: CacheManager) -> None:
        """Listen to ``manager``'s block events (until ``close()``)."""
        manager.add_listener(self.on_event)
        self._managers.append(manager)

    def on_event(self, event: CacheEvent) -> None:
        """Queue one manager event for the next batch."""
        if self._closed:
            raise PublisherClosedError("the publisher is closed")
        self._pending.append(to_wire(event))

    def flush(self) -> int | None:
        """Publish the queued events as one batch; its sequence number, or None when nothing was
        queued."""
        if self._closed:
            raise PublisherClosedError("the publisher is closed")
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        return self.publish_payload(encode_batch(batch, self.layout))

    def publish_payload(self, payload: bytes) -> int:
        """Send an already encoded payload under the next sequence number (and buffer it)."""
        if self._closed:
            raise PublisherClosedError("the publisher is closed")
        seq = self._seq
        self._seq += 1
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self.topic, encode_seq(seq), payload))
        return seq

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    def close(self) -> None:
        """Stop the replay thread and close the sockets (queued events are dropped)."""
        if self._closed:
            return
        self._closed = True
        for manager in self._managers:  # a closed publisher takes no more events
            with suppress(InvalidArgumentError):
                manager.remove_listener(self.on_event)
        self._managers.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        while not self._stop.is_set():
            try:
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                if len(frames) != 3:
                    raise WireFormatError(f"{len(frames)} frames, expected 3")
                identity, _, start_bytes = frames
                start = decode_seq(start_bytes)
            except WireFormatError as exc:
                log.warning("ignored a malformed replay request: %s", exc)
                continue
            with self._buffer_lock:
                replay = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in replay:
                    router.send_multipart((identity, b"", self.topic, encode_seq(seq), payload))
                router.send_multipart((identity, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("replay to a subscriber failed: %s", exc)
