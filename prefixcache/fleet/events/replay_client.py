"""Ask a replica's replay endpoint for the event batches a subscriber missed.

The request is ``(b"", start seq as 8 big-endian bytes)`` on a DEALER socket; the publisher
answers every batch it still buffers from ``start`` on, as ``(b"", topic, seq, payload)``, then
``(b"", b"", END_SEQ, b"")``, as vLLM's and SGLang's ``ZmqEventPublisher`` do (see ``wire``);
the shape without the topic frame, ``(b"", seq, payload)`` ended by ``(b"", END_SEQ, b"")``, is
read too. A gap is filled only when every batch of it comes back.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from prefixcache.errors import WireFormatError
from prefixcache.fleet.events.wire import END_SEQ, decode_seq, encode_seq

log = logging.getLogger(__name__)


def fetch_batches(
    context: zmq.Context[Any],
    endpoint: str,
    start: int,
    end: int,
    *,
    timeout_s: float,
    replica: str,
    max_message_bytes: int = -1,
) -> list[tuple[int, bytes]] | None:
    """Batches ``start .. end-1`` as (seq, payload) pairs in order, from the replay endpoint
    at ``endpoint``; None when it cannot provide them all (no answer within ``timeout_s``, a
    bad answer, or batches it no longer has). ``replica`` names the replica in the log; an
    answer with a frame over ``max_message_bytes`` (-1: no limit) is dropped by ZMQ, and times
    out."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    got: dict[int, bytes] = {}
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", encode_seq(start)))
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                log.warning("replica %s: replay timed out", replica)
                return None
            frames = sock.recv_multipart()
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
            if start <= s < end:
                got[s] = payload
    except (zmq.ZMQError, WireFormatError) as exc:
        log.warning("replica %s: replay failed: %s", replica, exc)
        return None
    finally:
        sock.close(linger=0)
    if len(got) != end - start:
        return None
    return sorted(got.items())
