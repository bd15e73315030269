"""Ask a replica's replay endpoint for the event batches a subscriber missed.

The request is ``(b"", start seq as 8 big-endian bytes)`` on a DEALER socket; the publisher
answers every batch it still buffers from ``start`` on, as ``(b"", seq, payload)``, then
``(b"", END_SEQ, b"")`` (see ``wire``). A gap is filled only when every batch of it comes back.
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
) -> list[tuple[int, bytes]] | None:
    """Batches ``start .. end-1`` as (seq, payload) pairs in order, from the replay endpoint
    at ``endpoint``; None when it cannot provide them all (no answer within ``timeout_s``, a
    bad answer, or batches it no longer has). ``replica`` names the replica in the log."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    got: dict[int, bytes] = {}
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", encode_seq(start)))
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                log.warning("replica %s: replay timed out", replica)
                return None
            frames = sock.recv_multipart()
            if len(frames) != 3:
                return None
            if frames[1] == END_SEQ:
                break
            s = decode_seq(frames[1])
            if start <= s < end:
                got[s] = frames[2]
    except (zmq.ZMQError, WireFormatError) as exc:
        log.warning("replica %s: replay failed: %s", replica, exc)
        return None
    finally:
        sock.close(linger=0)
    if len(got) != end - start:
        return None
    return sorted(got.items())
