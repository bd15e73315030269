"""Ask a replica's replay endpoint for the event batches a subscriber missed.

The request is ``(b"", start seq as 8 big-endian bytes)`` on a DEALER socket; the publisher
answers every batch it still buffers from ``start`` on, as ``(b"", topic, seq, payload)``, then
``(b"", b"", END_SEQ, b"")``, as vLLM's and SGLang's ``ZmqEventPublisher`` do (see ``wire``);
the shape without the topic frame, ``(b"", seq, payload)`` ended by ``(b"", END_SEQ, b"")``, is
read too. A gap is filled only when every batch of it comes back.

A replay is bounded: it ends as soon as every batch asked for is in, after ``deadline_s`` in
all, or after ``max_frames`` answer frames, whichever comes first; an endpoint that answers
slowly (or without end) is a gap it cannot fill, and holds the ingestion up no longer than that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from prefixcache.errors import WireFormatError
from prefixcache.fleet.events.wire import END_SEQ, decode_seq, encode_seq

log = logging.getLogger(__name__)

DEFAULT_REPLAY_DEADLINE_S = 2.0  # the longest one replay may take, all frames together
DEFAULT_MAX_REPLAY_FRAMES = 20_001  # vLLM buffers 10_000 batches by default, plus the end


def fetch_batches(
    context: zmq.Context[Any],
    endpoint: str,
    start: int,
    end: int | None,
    *,
    timeout_s: float,
    replica: str,
    max_message_bytes: int = -1,
    deadline_s: float = DEFAULT_REPLAY_DEADLINE_S,
    max_frames: int = DEFAULT_MAX_REPLAY_FRAMES,
) -> list[tuple[int, bytes]] | None:
    """Batches ``start .. end-1`` as (seq, payload) pairs in order, from the replay endpoint
    at ``endpoint``; None when it cannot provide them all (no answer within ``timeout_s``, a
    bad answer, batches it no longer has, not all of them within ``deadline_s`` or within
    ``max_frames`` answer frames); ``end`` None asks for every batch it buffers from ``start``
    on, up to its end marker (an empty list when there is none). ``replica`` names the replica
    in the log; an answer with a frame over ``max_message_bytes`` (-1: no limit) is dropped by
    ZMQ, and times out."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    got: dict[int, bytes] = {}
    until = time.monotonic() + deadline_s
    frames_read = 0
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", encode_seq(start)))
        while end is None or len(got) < end - start:
            left = until - time.monotonic()
            if left <= 0:
                log.warning("replica %s: replay past its %.3g s deadline", replica, deadline_s)
                return None
            if frames_read >= max_frames:
                log.warning("replica %s: replay past %d frames", replica, max_frames)
                return None
            if not sock.poll(max(1, int(min(timeout_s, left) * 1000))):
                log.warning("replica %s: replay timed out", replica)
                return None
            frames = sock.recv_multipart()
            frames_read += 1
            if len(frames) == 4:  # b"", topic, seq, payload
                seq_frame, payload = frames[2], frames[3]
            elif len(frames) == 3:  # b"", seq, payload
                seq_frame, payload = frames[1], frames[2]
            else:
                log.warning("replica %s: replay answer of %d frames", replica, len(frames))
                return None
            if frames[0] != b"":
                log.warning("replica %s: replay answer without its empty first frame", replica)
                return None
            if seq_frame == END_SEQ:
                break
            s = decode_seq(seq_frame)
            if start <= s and (end is None or s < end):
                got[s] = payload
    except (zmq.ZMQError, WireFormatError) as exc:
        log.warning("replica %s: replay failed: %s", replica, exc)
        return None
    finally:
        sock.close(linger=0)
    if end is not None and len(got) != end - start:
        return None
    return sorted(got.items())
