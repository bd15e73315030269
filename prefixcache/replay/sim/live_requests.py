"""The requests a serving simulation holds between arrival and finish, and their decoding samples.

A decoding sample's token counts are kept lazily: ``kv_len`` and ``generated`` are exact as of
its simulator's step count ``synced``, and every step since then added one to each (a sample in
the batch decodes one token a step), so the current values are those plus the steps since.
The simulator brings a sample up to date (``sync``) whenever it touches it.
"""

from __future__ import annotations

import numpy as np

from prefixcache.replay.workload.request import Request


class DecodingSample:
    """One sample of a request after its prefill: its K/V length and sampled output."""

    __slots__ = (
        "alive",
        "flushed",
        "generated",
        "index",
        "kv_len",
        "limit",
        "must_flush",
        "out",
        "owner",
        "rid",
        "synced",
        "version",
    )

    def __init__(
        self,
        owner: LiveRequest,
        index: int,
        rid: object,
        kv_len: int,
        generated: int,
        out: bytes,
        synced: int,
    ) -> None:
        self.owner = owner
        self.index = index  # the sample's position among its request's samples
        self.rid = rid  # its id in the cache manager
        self.kv_len = kv_len  # tokens whose K/V are written (some maybe not yet flushed)
        self.flushed = kv_len  # tokens handed to the manager
        self.generated = generated  # output tokens sampled so far
        self.limit = owner.req.output_len  # it finishes once it has sampled that many
        self.out = out  # its output tokens, int32 LE
        self.must_flush = True  # the first write may copy a block shared with a fork
        self.synced = synced  # the step count at which kv_len and generated are exact
        self.version = 0  # its current entry in the event queue carries this number
        self.alive = True  # False once released (finished, preempted or dropped)

    def sync(self, steps: int) -> None:
        """Bring ``kv_len`` and ``generated`` up to ``steps``: one token each step since."""
        gone = steps - self.synced
        if gone:
            self.kv_len += gone
            self.generated += gone
            self.synced = steps

    def kv_at(self, steps: int) -> int:
        """``kv_len`` at step count ``steps`` (without changing it)."""
        return self.kv_len + steps - self.synced


class LiveRequest:
    """A request between arrival and finish: waiting, prefilling or decoding its samples."""

    __slots__ = (
        "digests",
        "first_done",
        "idx",
        "kv",
        "out0",
        "prefill_left",
        "prompt_bytes",
        "rank",
        "recorded",
        "req",
        "resume",
        "seqs",
        "tokens",
    )

    def __init__(self, idx: int, req: Request) -> None:
        self.idx, self.req = idx, req
        self.tokens: np.ndarray = req.tokens  # what the next admission prefills
        self.resume = 0  # output tokens sampled before a preemption
        self.prefill_left = 0
        self.kv = 0  # tokens with K/V in place (cached or computed)
        self.seqs: list[DecodingSample] = []
        self.first_done = False
        self.recorded = False
        self.prompt_bytes = b""  # the prompt's token bytes, once accounted
        self.out0: bytes | None = None  # the first sample's output tokens (int32 LE)
        self.digests: list[bytes] | None = None  # the prompt's block digests, when known
        self.rank = 0  # admission order among the running requests (set when admitted)
