"""A serving replay's infinite-cache shadow, made beside the cached pass instead of in it.

The shadow (``accounting.Shadow``) hashes every full-block prefix a replay admits or grows by its
output, and remembers it: about a sixth of a one-replica serving replay's cached pass on 16-token
blocks. Nothing in that pass reads what the shadow answers (the misses it splits by cause, the
upper bound) before the end, where they go to the totals and to the rows. So where the no-cache
pass runs in a side process (``side_process.SideRun``), the cached pass only logs each
observation (``Accountant.defer_shadow``: three integers for a record, three for an output),
streams the log to the side process with the number of requests it has read so far, and keeps a
copy in an anonymous temporary file (``ShadowFeed``). The side process reads the workload once
for both its passes (``paced_with_shadow``): its no-cache pass reads at most ``AHEAD`` requests
beyond the cached pass, and a ``ShadowMaker`` makes the observations in the log's order as their
requests come, holding each request until the log has named it. What the shadow answered goes
back with the no-cache figures, and ``Accountant.settle_shadow`` adds it. Where the side process
ends without it, ``answer_shadow`` makes the same observations here, over the copy: the figures
are the same either way.
"""

from __future__ import annotations

import tempfile
from array import array
from collections.abc import Iterable, Iterator
from typing import IO

from prefixcache.blocks.tokens import as_token_bytes
from prefixcache.replay.sim.accounting import Shadow, ShadowAnswers, split_misses
from prefixcache.replay.sim.side_process import FeedPipe
from prefixcache.replay.workload.request import Request

__all__ = ["ShadowFeed", "ShadowMaker", "answer_shadow", "finish_shadow", "paced_with_shadow"]

_READ = 3 * 8 * 4096  # bytes of the kept log read at a time (whole events)
SHADOW_BATCH = 256  # observations (or requests read) the cached pass sends at a time
AHEAD = 512  # requests the no-cache pass may read beyond the cached pass (two batches at least)


class ShadowFeed:
    """Where the cached pass's batches of observations go: to the side process through
    ``pipe`` (when there is one), and to a temporary file, read back by ``batches``."""

    def __init__(self, pipe: FeedPipe | None) -> None:
        self.pipe = pipe
        # open as long as the feed is (no context manager): gone with it, a crash included
        self._kept: IO[bytes] = tempfile.TemporaryFile(prefix="prefixcache-shadow-")  # noqa: SIM115

    def __call__(self, batch: bytes, read: int) -> None:
        """A batch, and the requests the cached pass has read by then (sent before it)."""
        self._kept.write(batch)
        if self.pipe is not None:
            self.pipe.send(read.to_bytes(8, "little") + batch)

    def end(self) -> None:
        """No more batches: the side process's shadow can finish."""
        if self.pipe is not None:
            self.pipe.close()

    def batches(self) -> Iterator[bytes]:
        """The batches kept, again (whole events, not the sizes sent)."""
        kept = self._kept
        kept.flush()
        kept.seek(0)
        while chunk := kept.read(_READ):
            yield chunk

    def close(self) -> None:
        self._kept.close()


class ShadowMaker:
    """Makes the logged observations (``accounting.DeferredShadow``) on a fresh shadow, in
    order, as their requests are read (``offer``, in the order the indices count), and splits
    each record's misses as ``Accountant.record`` does."""

    def __init__(self, block_size: int, track_isolation: bool) -> None:
        self.p = block_size
        self.shadow = Shadow(block_size, track_isolation)
        self.held: dict[int, Request] = {}  # read, and named by an event to come
        self.read = 0  # requests offered
        self.events = array("q")  # received, from ``done`` on not made yet
        self.done = 0
        self.main_read = 0  # requests the cached pass had read, as last sent
        self.misses = array("q")
        self.ub_tokens = self.ub_blocks = 0

    def offer(self, req: Request) -> None:
        """The next request of the workload."""
        self.held[self.read] = req
        self.read += 1

    def receive_sent(self, message: bytes) -> None:
        """More of the log, as ``ShadowFeed`` sends it: the requests the cached pass read, then
        the batch."""
        self.main_read = int.from_bytes(message[:8], "little")
        self.receive(message[8:])

    def receive(self, batch: bytes) -> None:
        """More of the log."""
        if self.done:
            del self.events[: self.done]
            self.done = 0
        self.events.frombytes(batch)

    @property
    def waiting(self) -> bool:
        """An observation received names a request not offered yet."""
        return self.done < len(self.events)

    def make(self) -> None:
        """Make the observations received, in order, up to one whose request is not read."""
        events, p, shadow, held = self.events, self.p, self.shadow, self.held
        i = self.done
        while i < len(events) and events[i] >> 1 < self.read:
            code, amount, flags = events[i], events[i + 1], events[i + 2]
            i += 3
            idx = code >> 1
            req = held.pop(idx, None)
            if req is None:
                raise ValueError(f"the shadow's log names request {idx} once too often")
            prompt = as_token_bytes(req.tokens)
            t = len(prompt) // 4
            if code & 1:  # the sequence grew by ``amount`` tokens of its given output
                assert req.output_tokens is not None
                grown = prompt + as_token_bytes(req.output_tokens)[: 4 * amount]
                shadow.observe(grown, len(grown) // (4 * p), req.namespace, t // p)
                continue
            cow = bool(flags & 1)
            f = t // p
            _, u, v = shadow.observe(prompt, f, req.namespace, f if cow else amount // p)
            cold, capacity, isolation, routing, ub = split_misses(
                p, t, amount, cow, u, v, flags >> 2
            )
            self.misses.extend((cold, capacity, isolation, routing))
            self.ub_tokens += ub
            self.ub_blocks += u
            if flags & 2:  # its output may follow
                held[idx] = req
        self.done = i

    def answers(self) -> ShadowAnswers:
        return ShadowAnswers(self.misses.tobytes(), self.ub_tokens, self.ub_blocks)


def answer_shadow(
    requests: Iterable[Request], batches: Iterable[bytes], block_size: int, track_isolation: bool
) -> ShadowAnswers:
    """The shadow's answers to the log ``batches``, over ``requests`` (the workload), each
    read when the log first names it."""
    maker = ShadowMaker(block_size, track_isolation)
    it = iter(requests)
    for batch in batches:
        maker.receive(batch)
        maker.make()
        while maker.waiting:
            req = next(it, None)
            if req is None:
                raise ValueError("the shadow's log names a request past the workload's end")
            maker.offer(req)
            maker.make()
    return maker.answers()


def paced_with_shadow(
    requests: Iterable[Request], pipe: FeedPipe, maker: ShadowMaker, ahead: int = AHEAD
) -> Iterator[Request]:
    """``requests`` for another pass (the no-cache pass) that reads the workload once for both:
    each is offered to ``maker`` too, and the log received so far made. The pass reads at most
    ``ahead`` requests beyond those the cached pass had read when it last sent, and waits for
    the log otherwise, so the requests held stay about the cached pass's own: those it has read
    and not admitted yet, and those whose output it will log."""
    for req in requests:
        maker.offer(req)
        yield req
        wait = False
        while True:
            for message in pipe.received(wait):
                maker.receive_sent(message)
            maker.make()
            wait = maker.read > maker.main_read + ahead and not pipe.ended
            if not wait:
                break


def finish_shadow(pipe: FeedPipe, maker: ShadowMaker) -> ShadowAnswers:
    """The rest of the log, made once the workload has been offered whole."""
    while True:
        for message in pipe.received(True):
            maker.receive_sent(message)
        maker.make()
        if pipe.ended:
            break
    if maker.waiting:
        raise ValueError("the shadow's log names a request past the workload's end")
    return maker.answers()
