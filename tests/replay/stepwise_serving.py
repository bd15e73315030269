"""The step-by-step serving simulation that the event-driven loop replaced, kept verbatim as the
oracle of the equality tests (``test_replay_event_loop.py``): every decode step of every running
request simulated one by one, the no-cache pass on a real manager with caching off.

Serving replay: a continuous-batching simulation over the real cache manager.

Each step has a token budget. Running requests go first, in admission order: a prefilling one
takes a chunk of its uncached prompt, a decoding sequence one token. Waiting requests are then
admitted first come, first served while budget and blocks last (admission allocates the whole
prompt). A step lasts as long as the roofline says (``roofline``). Decode allocates a block when
a sequence crosses into a new one; when none is left, the latest admitted request is preempted
(released, requeued at the front and later recomputed, as vLLM does). Finished requests are
released.

Decoded tokens reach the manager in runs: only when a token starts or completes a block, or is
the first write after a fork, so block allocation, commits and copies happen exactly when they
would with one call per token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from prefixcache.errors import OutOfBlocksError, RequestTooLargeError
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.run_result import ServingStats
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.roofline import Roofline, StepWork, context_pairs, prefill_pairs
from prefixcache.replay.sim.serving_figures import BenchmarkFigures, OfferedLoad, RequestTimes
from prefixcache.replay.tiers.admission import TierAdmitter
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.synth import TokenTape, stream_key


class _DecodingSample:
    """One sample of a request after its prefill: its K/V length and sampled output."""

    __slots__ = ("flushed", "generated", "kv_len", "must_flush", "out", "rid")

    def __init__(self, rid: object, kv_len: int, generated: int, out: np.ndarray) -> None:
        self.rid = rid
        self.kv_len = kv_len  # tokens whose K/V are written (some maybe not yet flushed)
        self.flushed = kv_len  # tokens the manager holds
        self.generated = generated  # output tokens sampled so far
        self.out = out
        self.must_flush = True  # the first write may copy a block shared with a fork


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
        "recorded",
        "req",
        "resume",
        "seqs",
        "tokens",
    )

    def __init__(self, idx: int, req: Request) -> None:
        self.idx, self.req = idx, req
        self.tokens = req.tokens  # what the next admission prefills
        self.resume = 0  # output tokens sampled before a preemption
        self.prefill_left = 0
        self.kv = 0  # tokens with K/V in place (cached or computed)
        self.seqs: list[_DecodingSample] = []
        self.first_done = False
        self.recorded = False
        self.prompt_bytes = b""  # the prompt's token bytes, once accounted
        self.out0: np.ndarray | None = None
        self.digests: list[bytes] | None = None  # the prompt's block digests, when known


class Simulator:
    """One replica's continuous batching over its cache manager, on a simulated clock."""

    def __init__(self, mgr: CacheManager, cfg: ResolvedConfig, acc: Accountant | None) -> None:
        o = cfg.options
        assert cfg.model is not None and cfg.gpu is not None, "resolve a serving-mode config"
        self.mgr, self.acc, self.block_size = mgr, acc, o.block_size
        self.roof = Roofline.for_gpu(cfg.model, cfg.gpu, o.tp)
        self.budget, self.max_seqs = o.token_budget, o.max_seqs
        self.tape = TokenTape(stream_key("serving-samples"))
        self.clock = 0.0
        self.steps = self.preemptions = self.truncated = 0
        self.times = RequestTimes()
        self.busy = 0.0  # seconds spent in steps
        self.running: list[LiveRequest] = []
        self.waiting: deque[LiveRequest] = deque()
        self.live_seqs = 0
        # a fleet's hook: leading full prompt blocks another replica holds (routing misses)
        self.elsewhere: Callable[[LiveRequest], int] | None = None
        # told how many requests finished in each step (a progress bar)
        self.on_finish: Callable[[int], None] | None = None
        self.tiers: TierAdmitter | None = None  # host tier and pool, when the replay has them

    # ---- main loop --------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> None:
        """Simulate ``requests`` (in arrival order) until every one has finished."""
        it: Iterator[Request] = iter(requests)
        nxt = next(it, None)
        idx = 0
        while True:
            while nxt is not None and nxt.arrival_s <= self.clock:
                self.waiting.append(LiveRequest(idx, nxt))
                self.times.add(nxt.arrival_s, len(nxt.tokens), nxt.output_len, nxt.n)
                idx += 1
                nxt = next(it, None)
            if not self.running and not self.waiting:
                if nxt is None:
                    break
                self.clock = nxt.arrival_s
                continue
            self._step()
        self._measure(final=True)

    def _step(self) -> None:
        budget = self.budget
        prefills: list[tuple[LiveRequest, int]] = []
        decodes: list[_DecodingSample] = []
        work = StepWork()
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.prefill_left:
                if budget:
                    k = min(r.prefill_left, budget)
                    budget -= k
                    prefills.append((r, k))
                    work.add(
                        k,
                        prefill_pairs(r.kv, k),
                        r.kv + k,
                        int(k == r.prefill_left),
                        context_pairs(r.kv, k),
                    )
                i += 1
                continue
            mine: list[_DecodingSample] = []
            gone = False
            bs = self.block_size
            for s in r.seqs:
                if not budget:
                    break
                pos = s.kv_len
                if s.must_flush or pos % bs == 0 or (pos + 1) % bs == 0:
                    if not self._make_room(r, s):
                        gone = True
                        break
                else:  # the token lands in a block the sequence already owns
                    s.kv_len = pos + 1
                mine.append(s)
                budget -= 1
            if gone:
                continue  # r left self.running; index i now holds the next request
            decodes.extend(mine)
            for s in mine:
                work.add(1, s.kv_len, s.kv_len, 1, s.kv_len - 1)
            i += 1
        self._admit(budget, prefills, work)
        if not prefills and not decodes:
            return  # everything in flight was preempted; admit again next round
        seconds = self.roof.step_seconds(
            work.tokens, work.attention_pairs, work.kv_tokens_read, work.logits, work.context_pairs
        )
        seconds += work.transfer_s  # loads finish before the forward pass reads them
        self.clock += seconds
        self.busy += seconds
        self.steps += 1
        for r, k in prefills:
            r.prefill_left -= k
            r.kv += k
            if not r.prefill_left:
                self._start_decode(r)
        for s in decodes:
            s.generated += 1
        self._finish_done()
        self._measure()

    def _admit(self, budget: int, prefills: list[tuple[LiveRequest, int]], work: StepWork) -> None:
        mgr, acc, tiers = self.mgr, self.acc, self.tiers
        admit = mgr.admit if tiers is None else tiers.admit
        while self.waiting and budget:
            r = self.waiting[0]
            if self.live_seqs + r.req.n > self.max_seqs and self.running:
                break
            try:
                adm = admit(r.idx, r.tokens, r.req.namespace)
            except OutOfBlocksError:
                break
            except RequestTooLargeError:
                self.waiting.popleft()
                if r.recorded:
                    self.truncated += 1  # prompt plus recomputed output outgrew the cache
                else:
                    r.recorded = True
                    if acc is not None:
                        acc.record(r.idx, r.req, r.tokens.tobytes(), 0, False, 0, rejected=True)
                continue
            self.waiting.popleft()
            cached_len, partial, host_tokens, pool_tokens = adm.cached_len, adm.partial_tokens, 0, 0
            if tiers is not None:
                hit = tiers.split(
                    bytes(mgr.internals.states[r.idx].tokens), r.req.namespace, adm, r.digests
                )
                cached_len, partial = hit.cached_len, hit.partial_tokens
                host_tokens, pool_tokens = hit.host_tokens, hit.pool_tokens
                work.transfer_s += tiers.settings.load_seconds(hit.host_blocks, hit.pool_blocks)
            if not r.recorded:
                r.recorded = True
                if acc is not None:
                    r.prompt_bytes = bytes(mgr.internals.states[r.idx].tokens)  # no second copy
                    acc.record(
                        r.idx,
                        r.req,
                        r.prompt_bytes,
                        cached_len,
                        adm.cow,
                        partial,
                        elsewhere=self.elsewhere(r) if self.elsewhere is not None else 0,
                        host_tokens=host_tokens,
                        pool_tokens=pool_tokens,
                    )
            r.kv = cached_len
            r.prefill_left = len(r.tokens) - cached_len
            self.running.append(r)
            self.live_seqs += r.req.n
            k = min(r.prefill_left, budget)
            budget -= k
            prefills.append((r, k))
            last = int(k == r.prefill_left)
            work.add(k, prefill_pairs(r.kv, k), r.kv + k, last, context_pairs(r.kv, k))

    # ---- sequences --------------------------------------------------------------------------
    def _start_decode(self, r: LiveRequest) -> None:
        if not r.first_done:
            r.first_done = True
            self.times.ttft[r.idx] = self.clock - r.req.arrival_s
        req, kv = r.req, len(r.tokens)
        if r.out0 is None:
            given = req.output_tokens
            r.out0 = given if given is not None else self.tape.take(req.output_len)
        first = _DecodingSample(r.idx, kv, r.resume + 1, r.out0)
        r.seqs = [first]
        for j in range(1, req.n):
            self.mgr.fork(r.idx, (r.idx, j))
            r.seqs.append(_DecodingSample((r.idx, j), kv, 1, self.tape.take(req.output_len)))

    def _write(self, s: _DecodingSample) -> bool:
        """Hand the manager the tokens written since the last call, up to the last sampled one
        (it starts or fills a block, or follows a fork). False when no block is free for it."""
        pos = s.kv_len
        base = pos - s.generated + 1  # position of out[0]
        pending = s.out[s.flushed - base : pos - base + 1]
        try:
            self.mgr.append(s.rid, int(pending[0]) if len(pending) == 1 else pending)
        except OutOfBlocksError:
            return False
        s.flushed = s.kv_len = pos + 1
        s.must_flush = False
        return True

    def _make_room(self, r: LiveRequest, s: _DecodingSample) -> bool:
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
        for s in r.seqs:
            self.mgr.release(s.rid)
        if not r.seqs:  # still prefilling
            self.mgr.release(r.idx)
        self.live_seqs -= len(r.seqs) or r.req.n
        self.running.remove(r)

    def _drop(self, r: LiveRequest) -> None:
        self._release_all(r)
        r.seqs = []

    def _preempt(self, r: LiveRequest) -> None:
        """Release ``r`` and queue it first, to be recomputed (by preemption, as in vLLM)."""
        self.preemptions += 1
        self._release_all(r)
        if r.seqs and r.req.n == 1:  # recompute the prompt and the output so far, then go on
            assert r.out0 is not None
            r.resume = r.seqs[0].generated
            r.tokens = np.concatenate([r.req.tokens, r.out0[: r.resume]])
        elif r.seqs:  # parallel samples restart from the prompt
            r.resume = 0
            r.tokens = r.req.tokens
        r.seqs = []
        r.prefill_left = 0
        self.waiting.appendleft(r)

    def _finish_done(self) -> None:
        keep: list[LiveRequest] = []
        done = 0
        for r in self.running:
            if r.prefill_left or not r.seqs:
                keep.append(r)
                continue
            live = []
            for s in r.seqs:
                if s.generated >= r.req.output_len:
                    if s is r.seqs[0] and r.req.output_tokens is not None and self.acc:
                        written = r.prompt_bytes + s.out[: s.kv_len - len(r.req.tokens)].tobytes()
                        self.acc.note_output(r.idx, r.req, written)
                    self.mgr.release(s.rid)
                    self.live_seqs -= 1
                else:
                    live.append(s)
            r.seqs = live
            if live:
                keep.append(r)
                continue
            done += 1
            self.times.finish[r.idx] = self.clock
        self.running = keep
        if done and self.on_finish is not None:
            self.on_finish(done)

    # ---- measurements -----------------------------------------------------------------------
    def _measure(self, final: bool = False) -> None:
        """Peak usage every step; a timeline row when due."""
        acc = self.acc
        if acc is None:
            return
        used = self.mgr.block_counts()
        logical, frag = self.usage()
        acc.note_usage(used.active, logical, frag)
        acc.sample_timeline(self.steps, self.clock, used, self.mgr.stats.evicted_blocks, final)

    @property
    def ttft(self) -> list[float]:
        """Seconds to the first token, per request (NaN: not served yet)."""
        return self.times.ttft

    def figures(self) -> BenchmarkFigures:
        """Throughput and latency of the requests simulated so far."""
        return self.times.figures(self.busy)

    def usage(self) -> tuple[int, int]:
        """Logical blocks of the running requests and the unused slots of their last blocks."""
        p = self.block_size
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
                    frag += blocks * p - s.kv_len
            if shared_tail:
                frag += -(-len(r.tokens) // p) * p - len(r.tokens)
        return logical, frag


def run_serving(
    requests: Iterable[Request],
    mgr: CacheManager,
    acc: Accountant,
    cfg: ResolvedConfig,
    on_finish: Callable[[int], None] | None = None,
    tiers: TierAdmitter | None = None,
    *,
    reopen: Callable[[], Iterable[Request]] | None = None,  # the same requests: kept here
) -> ServingStats:
    """Simulate ``requests`` with the cache, then the same requests (kept whole) without it,
    at the same capacity, for the no-cache figures. ``on_finish`` is told how many requests
    completed, step by step, in both simulations. ``tiers``: admit through the host tier and
    pool it manages (their loads add to the step times)."""
    again = list(requests)
    sim = Simulator(mgr, cfg, acc)
    sim.on_finish = on_finish
    sim.tiers = tiers
    sim.run(again)
    plain = cfg.cache_manager(caching=False)
    base = Simulator(plain, cfg, None)
    base.on_finish = on_finish
    base.run(again)
    times = sim.times
    return ServingStats(
        times.ttft,
        base.times.ttft,
        sim.preemptions,
        sim.steps,
        sim.clock - min(times.arrival, default=sim.clock),  # first arrival to last finish
        sim.truncated,
        with_cache=sim.figures(),
        without_cache=base.figures(),
        load=OfferedLoad(
            times.span,
            sim.busy,
            base.busy,
            cfg.options.rate_scale / cfg.options.time_scale,
            ttft_growth_s=times.ttft_growth(),
        ),
        assumptions=sim.roof.assumptions(),
    )
