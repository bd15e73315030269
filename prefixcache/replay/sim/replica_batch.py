"""The batch one replica of a serving simulation runs: its requests, their decoding samples and
the blocks they hold, in the cache manager or (caching nothing) in ``UncachedBlocks``.

``ReplicaBatch`` carries out what a step decides: a sample's write (the tokens since its last
one, when a token starts or fills a block or follows a fork), the preemptions a write that finds
no block sets off (the latest admitted request first, as vLLM does), a prefill's end (the first
token, forks for parallel samples) and the release of finished samples. It keeps the counters
the event loop (``serving``) reads instead of visiting the batch: decoding samples and their
K/V tokens (each adds one a step), logical blocks, and two numbers that say when a refused
admission is worth trying again: ``epoch`` moves with every call that may give blocks back or
change the index beyond a commit, ``committed`` counts the blocks decode writes filled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from prefixcache.errors import OutOfBlocksError
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.request_blocks import TokenAppender
from prefixcache.manager.state import ManagerInternals
from prefixcache.manager.stats import BlockCounts
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.live_requests import DecodingSample, LiveRequest
from prefixcache.replay.sim.serving_figures import RequestTimes
from prefixcache.replay.sim.uncached_blocks import UncachedBlocks
from prefixcache.replay.workload.synth import TokenTape, stream_key


def _token_bytes(tokens: np.ndarray) -> bytes:
    """Output tokens as the int32 LE bytes the manager is handed."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


class ReplicaBatch:
    """One replica's requests in flight and the blocks they hold. ``mgr``: the cache manager,
    or ``UncachedBlocks`` for a replica that caches nothing."""

    def __init__(
        self, mgr: CacheManager | UncachedBlocks, block_size: int, acc: Accountant | None
    ) -> None:
        self.cache: CacheManager | None = mgr if isinstance(mgr, CacheManager) else None
        self.append: TokenAppender | None = self.cache.appender() if self.cache else None
        # its counts read from inside, with no Python property between (a reset is seen)
        self.inside: ManagerInternals | None = self.cache.internals if self.cache else None
        self.counts: UncachedBlocks | None = mgr if isinstance(mgr, UncachedBlocks) else None
        self.acc, self.block_size = acc, block_size
        self.commit_writes = self.cache is not None  # blocks are committed as they fill
        self.tape = TokenTape(stream_key("serving-samples"))
        self.clock = 0.0
        self.steps = self.preemptions = self.truncated = 0
        self.times = RequestTimes()
        self.running: list[LiveRequest] = []  # in admission order
        self.waiting: deque[LiveRequest] = deque()
        self.live_seqs = 0
        # told how many requests finished in each step (a progress bar)
        self.on_finish: Callable[[int], None] | None = None
        self.n_dec = 0  # decoding samples in the batch
        self.kv_base = 0  # their K/V tokens at step kv_step; each adds one a step
        self.kv_step = 0
        self.prefilling = 0  # running requests with prompt left to compute
        self.logical = 0  # logical blocks of the running requests (``usage``)
        self.epoch = 0  # moves with every call that may give blocks back or change the index
        self.committed = 0  # blocks decode writes have filled (each may extend the index)

    @property
    def mgr(self) -> CacheManager:
        """The cache manager (a replica that caches nothing has none)."""
        assert self.cache is not None, "an uncached replica has no cache manager"
        return self.cache

    def active_blocks(self) -> int:
        """Physical blocks in use now (``block_counts().active``, read without building the
        counts)."""
        inside = self.inside
        if inside is not None:
            return inside.radix_index.active_blocks + inside.pool.num_private
        assert self.counts is not None
        return self.counts.active_blocks()

    def free_or_evictable(self) -> int:
        """Blocks an allocation could get now (free, or cached and held by nobody)."""
        inside = self.inside
        if inside is not None:
            index = inside.radix_index
            return inside.pool.num_free + index.num_blocks - index.active_blocks
        assert self.counts is not None
        return self.counts.free

    def block_counts(self) -> BlockCounts:
        """Free, active and cached blocks now."""
        if self.cache is not None:
            return self.cache.block_counts()
        assert self.counts is not None
        active = self.counts.active_blocks()
        return BlockCounts(self.counts.num_blocks - active, active, 0)

    def evicted_blocks(self) -> int:
        """Blocks evicted so far."""
        return self.cache.stats.evicted_blocks if self.cache is not None else 0

    def _release(self, rid: object) -> None:
        if self.cache is not None:
            self.cache.release(rid)
        else:
            assert self.counts is not None
            self.counts.release(rid)
        self.epoch += 1

    def _kv_now(self) -> int:
        """The decoding sequences' K/V tokens at the current step count."""
        return self.kv_base + self.n_dec * (self.steps - self.kv_step)

    def _kv_add(self, tokens: int) -> None:
        """Add ``tokens`` (negative: take away) to the decoders' K/V sum at the current step."""
        self.kv_base = self._kv_now() + tokens
        self.kv_step = self.steps

    def _start_decode(self, r: LiveRequest) -> list[DecodingSample]:
        """The prefill just ended: the first token is out (TTFT); the samples start decoding,
        exact at the current step count. Returns them (the caller queues them)."""
        if not r.first_done:
            r.first_done = True
            self.times.ttft[r.idx] = self.clock - r.req.arrival_s
        req, kv = r.req, len(r.tokens)
        if r.out0 is None:
            given = req.output_tokens
            r.out0 = _token_bytes(given) if given is not None else self._outputs(req.output_len)
        now = self.steps
        first = DecodingSample(r, 0, r.idx, kv, r.resume + 1, r.out0, now)
        r.seqs = [first]
        for j in range(1, req.n):
            if self.cache is not None:
                self.cache.fork(r.idx, (r.idx, j))
            else:
                assert self.counts is not None
                self.counts.fork(r.idx, (r.idx, j))
            out = self._outputs(req.output_len)
            r.seqs.append(DecodingSample(r, j, (r.idx, j), kv, 1, out, now))
        if req.n > 1:
            self.epoch += 1
        self.n_dec += req.n
        self._kv_add(req.n * kv)
        self.logical += (req.n - 1) * -(-kv // self.block_size)
        return r.seqs

    def _outputs(self, n: int) -> bytes:
        """A sample's ``n`` output tokens (int32 LE): drawn from the tape, or (caching nothing,
        so no token is ever read) all 0 without drawing them."""
        if self.cache is None:
            return bytes(4 * n)
        return _token_bytes(self.tape.take(n))

    def _write_due(self, s: DecodingSample) -> bool:
        """Whether the token ``s`` decodes now (at ``kv_len``) goes to the manager: it starts a
        block, fills one (when blocks are committed), or is the first after a fork."""
        bs = self.block_size
        pos = s.kv_len
        return s.must_flush or pos % bs == 0 or (self.commit_writes and (pos + 1) % bs == 0)

    def _write(self, s: DecodingSample) -> bool:
        """Hand the manager the tokens written since the last call, up to the one decoded now
        (it starts or fills a block, or follows a fork). False when no block is free for it."""
        pos = s.kv_len
        flushed = s.flushed
        append = self.append
        if append is not None:
            base = pos - s.generated + 1  # position of the first output token
            try:
                append(s.rid, s.out[4 * (flushed - base) : 4 * (pos - base + 1)])
            except OutOfBlocksError:
                return False
        else:
            assert self.counts is not None
            if not self.counts.append(s.rid, pos + 1 - flushed):
                return False
        bs = self.block_size
        self.committed += (pos + 1) // bs - flushed // bs
        self.logical += -(-(pos + 1) // bs) + flushed // -bs
        if s.must_flush:
            s.must_flush = False
            self.epoch += 1  # a first write lets go of a copy source
        s.flushed = pos + 1
        return True

    def _make_room(self, r: LiveRequest, s: DecodingSample) -> bool:
        """Write ``s``'s token, preempting the latest admitted requests while no block is free.
        False when ``r`` itself had to go."""
        while not self._write(s):
            victim = self.running[-1]
            if victim is r and len(self.running) == 1:
                self._drop(r)  # alone and still out of blocks: it can never grow in this cache
                self.truncated += 1
                return False
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _release_all(self, r: LiveRequest) -> None:
        now = self.steps
        kv = 0
        bs = self.block_size
        for s in r.seqs:
            self._release(s.rid)
            s.alive = False
            kv += s.kv_at(now)
            self.logical -= -(-s.flushed // bs)
        if not r.seqs:  # still prefilling
            self._release(r.idx)
            self.logical -= -(-len(r.tokens) // bs)
            if r.prefill_left:
                self.prefilling -= 1
        self.n_dec -= len(r.seqs)
        self._kv_add(-kv)
        self.live_seqs -= len(r.seqs) or r.req.n
        self.running.remove(r)

    def _drop(self, r: LiveRequest) -> None:
        self._release_all(r)
        r.seqs = []

    def _preempt(self, r: LiveRequest) -> None:
        """Release ``r`` and queue it first, to be recomputed (by preemption, as in vLLM)."""
        self.preemptions += 1
        for s in r.seqs:
            s.sync(self.steps)
        self._release_all(r)
        if r.seqs and r.req.n == 1:  # recompute the prompt and the output so far, then go on
            assert r.out0 is not None
            r.resume = r.seqs[0].generated
            out = np.frombuffer(r.out0, dtype="<i4", count=r.resume)
            r.tokens = np.concatenate([r.req.tokens, out])
        elif r.seqs:  # parallel samples restart from the prompt
            r.resume = 0
            r.tokens = r.req.tokens
        r.seqs = []
        r.prefill_left = 0
        self.waiting.appendleft(r)

    def _finish(self, ending: list[DecodingSample]) -> None:
        """Release the samples that sampled their last token in this step (in batch order), and
        the requests they complete."""
        acc = self.acc
        bs = self.block_size
        now = self.steps
        done = 0
        kv = 0
        i = 0
        while i < len(ending):
            r = ending[i].owner
            j = i
            while j < len(ending) and ending[j].owner is r:
                j += 1
            first = r.seqs[0]
            for s in ending[i:j]:
                if s is first and r.req.output_tokens is not None and acc is not None:
                    written = r.prompt_bytes + s.out[: 4 * (s.kv_len - len(r.req.tokens))]
                    acc.note_output(r.idx, r.req, written)
                self._release(s.rid)
                s.alive = False
                self.live_seqs -= 1
                kv += s.kv_at(now)
                self.logical -= -(-s.flushed // bs)
            self.n_dec -= j - i
            live = [s for s in r.seqs if s.alive]
            r.seqs = live
            if not live:
                done += 1
                self.times.finish[r.idx] = self.clock
                self.running.remove(r)
            i = j
        self._kv_add(-kv)
        if done and self.on_finish is not None:
            self.on_finish(done)

    @property
    def busy_now(self) -> bool:
        """Something is waiting or running."""
        return bool(self.running or self.waiting)

    def usage(self) -> tuple[int, int]:
        """Logical blocks of the running requests and the unused slots of their last blocks."""
        p = self.block_size
        now = self.steps
        logical = frag = 0
        for r in self.running:
            if not r.seqs:  # prefilling: the whole prompt is allocated
                blocks = -(-len(r.tokens) // p)
                logical += blocks
                frag += blocks * p - len(r.tokens)
                continue
            shared_tail = False
            for s in r.seqs:
                blocks = -(-s.flushed // p)
                logical += blocks
                if s.must_flush:  # still shares the prompt's last block
                    shared_tail = True
                else:
                    frag += blocks * p - s.kv_at(now)
            if shared_tail:
                frag += -(-len(r.tokens) // p) * p - len(r.tokens)
        return logical, frag
