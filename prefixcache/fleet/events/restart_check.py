"""Whether a replica that answers again after being down still runs the engine whose KV event
stream the subscriber applied, or a restarted one (empty cache, a new stream from batch 0).

An idle engine publishes nothing, so a restarted one is not seen in its stream until its first
request has been computed, which the index, still holding the old engine's blocks, would route
there predicting hits the engine no longer has. The replay endpoint tells at once: the engine
that published the last batch applied (vLLM's and SGLang's publishers keep their latest batches,
10,000 by default) answers it again, byte for byte; a restarted one has no such batch, or
another one under its number. ``StreamMark`` is what the subscriber notes of a stream before it
asks (without its lock held), ``same_engine`` the question.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import xxhash
import zmq

from prefixcache.fleet.events.replay_client import fetch_batches
from prefixcache.fleet.events.replica_stream import ReplicaStream


class StreamMark(NamedTuple):
    """A replica's stream as applied so far: its last batch and how many were applied."""

    replica: str
    replay_endpoint: str | None
    last_seq: int  # -1: no batch applied
    last_payload: int | None  # the last batch's payload hash (ReplicaStream.recent)
    applied: tuple[int, int, int]  # batches applied, resets, clears: changes with any batch


def stream_mark(rep: ReplicaStream) -> StreamMark:
    """What ``rep``'s stream is now (read under the subscriber's lock)."""
    counts = rep.counts
    return StreamMark(
        rep.ep.name,
        rep.ep.replay_endpoint,
        rep.last_seq,
        rep.recent.get(rep.last_seq),
        (counts.batches, counts.resets, counts.cleared),
    )


def same_engine(
    context: zmq.Context[Any],
    mark: StreamMark,
    *,
    timeout_s: float,
    deadline_s: float,
    max_message_bytes: int,
) -> bool:
    """Whether the replica's replay endpoint still answers the last batch applied, byte for
    byte: the engine that published it runs on. False when it cannot be told (no replay
    endpoint, no batch applied yet, no answer)."""
    if mark.replay_endpoint is None or mark.last_seq < 0 or mark.last_payload is None:
        return False
    got = fetch_batches(
        context,
        mark.replay_endpoint,
        mark.last_seq,
        mark.last_seq + 1,
        timeout_s=timeout_s,
        replica=mark.replica,
        max_message_bytes=max_message_bytes,
        deadline_s=deadline_s,
        max_frames=2,
    )
    return got is not None and xxhash.xxh3_64_intdigest(got[0][1]) == mark.last_payload
