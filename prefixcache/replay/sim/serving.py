"""Serving replay: a continuous-batching simulation over the real cache manager, event by event.

The model. Each step has a token budget. Running requests go first, in admission order: a
prefilling one takes a chunk of its uncached prompt, a decoding sequence one token. Waiting
requests are then admitted first come, first served while budget and blocks last (admission
allocates the whole prompt). A step lasts as long as the roofline says (``roofline``). Decode
allocates a block when a sequence crosses into a new one; when none is left, the latest admitted
request is preempted (released, requeued at the front and later recomputed, as vLLM does).
Finished requests are released. Decoded tokens reach the manager in runs: when a token starts
or completes a block, or is the first write after a fork, so block allocation, commits and
copies happen exactly when they would with one call per token.

The loop. Most steps change nothing but counters: every running sequence decodes one token and
the clock moves on. The simulation visits only the steps where something happens, and advances
the rest in closed form:

- an *event* is a sequence's next write (a block boundary, or its first write after a fork),
  its last token, an arrival, an admission that may succeed, a prefill chunk, or anything a
  preemption or a release sets off. Sequences sit in a queue keyed by the step of their next
  event (``_schedule``); between events their token counts are lazy (``live_requests``).
- a *quiet* step (no event due, nothing prefilling, every sequence within the budget) costs
  O(1): the step's work is a function of the number of sequences D and the sum of their K/V
  lengths K (D tokens and logits, D + K query-key pairs and K/V tokens read, K of them cached),
  and K grows by D a step. Time is the sum of each step's roofline time taken in order
  (``StepTimer``, the same floats as one step at a time), so every clock reading is the one a
  step-by-step simulation reads.
- an admission that failed stays failed until blocks come back or the index grows: a failed
  admission short of d blocks is not tried again until a release, an admission, a fork or a
  first write (which lets a copy source go), or until running sequences have committed d new
  blocks (a committed block can add at most one hit; allocations only take blocks away).
- steps with a prompt being prefilled in chunks, or with more sequences than the budget, are
  simulated in full (``_full_step``): every request in the batch is visited, as the budget
  decides who runs.

The no-cache pass runs the same loop over ``UncachedBlocks``, which answers as a manager with
caching off does, from block counts alone; where a second core is free, in a second process
while the cached pass runs (``serving_passes.run_serving``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator

from prefixcache.errors import OutOfBlocksError, RequestTooLargeError
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.replay.run_config import ResolvedConfig
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.sim.live_requests import DecodingSample, LiveRequest
from prefixcache.replay.sim.replica_batch import ReplicaBatch
from prefixcache.replay.sim.roofline import Roofline, StepWork, context_pairs, prefill_pairs
from prefixcache.replay.sim.serving_figures import BenchmarkFigures
from prefixcache.replay.sim.step_tally import StepTally
from prefixcache.replay.sim.uncached_blocks import UncachedBlocks
from prefixcache.replay.tiers.admission import TierAdmitter
from prefixcache.replay.workload.request import Request

__all__ = ["DecodingSample", "LiveRequest", "Simulator", "advance_replicas"]

Event = tuple[int, int, int, int, DecodingSample]  # (step, rank, sample, version, sample)


class Simulator(ReplicaBatch):
    """One replica's continuous batching over its cache, on a simulated clock. ``mgr``: the
    cache manager, or ``UncachedBlocks`` for a replica that caches nothing."""

    def __init__(
        self, mgr: CacheManager | UncachedBlocks, cfg: ResolvedConfig, acc: Accountant | None
    ) -> None:
        o = cfg.options
        assert cfg.model is not None and cfg.gpu is not None, "resolve a serving-mode config"
        super().__init__(mgr, o.block_size, acc)
        self.roof = Roofline.for_gpu(cfg.model, cfg.gpu, o.tp)
        self.timer = self.roof.timer()
        self.budget, self.max_seqs = o.token_budget, o.max_seqs
        self.busy = 0.0  # seconds spent in steps
        # a fleet's hook: leading full prompt blocks another replica holds (routing misses)
        self.elsewhere: Callable[[LiveRequest], int] | None = None
        # a fleet's hook, called after every step that may have changed blocks or requests
        self.after_step: Callable[[], None] | None = None
        self.tiers: TierAdmitter | None = None  # host tier and pool, when the replay has them
        self.tally: StepTally | None = None  # usage and timeline (run() makes one if needed)
        self.tally_slot = 0
        # prompt and hit tokens of the requests accounted here (a fleet's per-replica figures)
        self.prompt_tokens = self.hit_tokens = 0
        self.queue: list[Event] = []  # the samples, by the step of their next event
        self.next_rank = 0  # admission order
        self.blocked: LiveRequest | None = None  # the head whose admission failed last
        self.blocked_epoch = 0
        self.blocked_committed = 0
        self.blocked_short = 0  # blocks it lacked
        self.blocked_need = -1  # blocks it needed (-1: not said)
        self.blocked_admissions = 0
        self.admissions = 0  # successful admissions (each may lengthen any prompt's match)
        self.short_epoch = self.short_committed = -1  # when the head was last found short

    # ---- main loop --------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> None:
        """Simulate ``requests`` (in arrival order) until every one has finished."""
        if self.acc is not None and self.tally is None:
            StepTally(self.acc, [self], fleet=False)
        it: Iterator[Request] = iter(requests)
        nxt = next(it, None)
        idx = 0
        deferred = self.acc.deferred if self.acc is not None else None
        while True:
            while nxt is not None and nxt.arrival_s <= self.clock:
                self.waiting.append(LiveRequest(idx, nxt))
                self.times.add(nxt.arrival_s, len(nxt.tokens), nxt.output_len, nxt.n)
                idx += 1
                nxt = next(it, None)
            if deferred is not None:
                deferred.read_to(idx)
            if not self.running and not self.waiting:
                if nxt is None:
                    break
                self.clock = nxt.arrival_s
                continue
            self.run_steps(nxt.arrival_s if nxt is not None else math.inf, False)
        if self.tally is not None:
            self.tally.finish()

    def take(self, live: LiveRequest) -> None:
        """Queue a request routed here (a fleet's replica)."""
        if not (self.running or self.waiting) and self.clock < live.req.arrival_s:
            self.clock = live.req.arrival_s
        self.waiting.append(live)

    def run_steps(self, limit: float, inclusive: bool) -> None:
        """Step while something is in flight and the clock is before ``limit`` (or at it, when
        ``inclusive``)."""
        while self.running or self.waiting:
            clock = self.clock
            if clock > limit or (clock == limit and not inclusive):
                return
            if self._quiet():
                self._quiet_steps(limit, inclusive)
            else:
                self._event_step()

    def _quiet(self) -> bool:
        """Whether the next step only decodes, with no event due."""
        n = self.n_dec
        if not n or self.prefilling or n > self.budget:
            return False
        queue = self.queue
        if queue and queue[0][0] <= self.steps:
            return False
        return not (self.waiting and self.budget > n and self._would_try(self.waiting[0]))

    def _would_try(self, head: LiveRequest) -> bool:
        """Whether the admission of ``head`` would be tried now (``_admit``'s checks)."""
        if self.live_seqs + head.req.n > self.max_seqs and self.running:
            return False
        return not self._known_short(head)

    def _known_short(self, head: LiveRequest) -> bool:
        """``head`` failed to be admitted and nothing since could have made room for it: no
        call gave blocks back or changed the index but commits, fewer than it lacked; or, with
        no admission since, what it needed less what the commits could have matched exceeds
        the blocks free or evictable now (its need shrinks only as its match grows, and
        releases only change what is available)."""
        if head is not self.blocked:
            return False
        commits = self.committed - self.blocked_committed
        if self.epoch == self.blocked_epoch and commits < self.blocked_short:
            return True
        if self.admissions != self.blocked_admissions:
            return False
        if self.short_epoch == self.epoch and self.short_committed == self.committed:
            return True  # found short since, and nothing could have given it blocks
        if self.blocked_need - commits > self.free_or_evictable():
            self.short_epoch, self.short_committed = self.epoch, self.committed
            return True
        return False

    def _quiet_steps(self, limit: float, inclusive: bool) -> None:
        """Decode-only steps until an event is due or the clock reaches ``limit``."""
        timer, tally = self.timer, self.tally
        n = self.n_dec
        kv = self.kv_base + n * (self.steps - self.kv_step)
        queue = self.queue
        stop = queue[0][0] if queue else -1
        while True:
            pairs = kv + n
            seconds = timer.seconds(n, pairs, pairs, n, kv)
            self.clock += seconds
            self.busy += seconds
            self.steps += 1
            kv = pairs
            if tally is not None:
                tally.after_quiet(self)
            if self.steps == stop:
                break
            clock = self.clock
            if clock > limit or (clock == limit and not inclusive):
                break
        self.kv_base, self.kv_step = kv, self.steps

    # ---- one step with events ----------------------------------------------------------------
    def _event_step(self) -> None:
        if self.prefilling or self.n_dec > self.budget:
            timed = self._full_step()
        else:
            timed = self._decode_step()
        if self.after_step is not None:
            self.after_step()
        if self.tally is not None:
            self.tally.after_event(self, timed)

    def _decode_step(self) -> bool:
        """A step in which every running sequence decodes: only the sequences with an event due
        are visited. Returns whether time passed."""
        now = self.steps
        due: list[DecodingSample] = []
        queue = self.queue
        while queue and queue[0][0] <= now:
            event = heapq.heappop(queue)
            s = event[4]
            if s.alive and s.version == event[3]:
                due.append(s)
        spent = 0  # budget the samples of a request that had to go took before it went
        for s in due:
            if not s.alive:
                continue  # preempted by a write before it in this step
            s.sync(now)
            if self._write_due(s):
                r = s.owner
                before = r.seqs.index(s) if len(r.seqs) > 1 else 0
                if not self._make_room(r, s):
                    spent += before
        n = self.n_dec
        kv = self._kv_now()
        work = StepWork(n, kv + n, kv + n, n, 0.0, kv)
        prefills: list[tuple[LiveRequest, int]] = []
        self._admit(self.budget - n - spent, prefills, work)
        if not n and not prefills:
            return False  # everything in flight was preempted; admit again next round
        self._advance_clock(work)
        after = self.steps
        for s in due:
            if s.alive:
                s.kv_len += 1
                s.generated += 1
                s.synced = after
        self._kv_add(0)  # the decoders' tokens of this step, at the new step count
        ending = [s for s in due if s.alive and s.generated >= s.limit]
        for r, k in prefills:
            r.prefill_left -= k
            r.kv += k
            if r.prefill_left:
                self.prefilling += 1
                continue
            for s in self._start_decode(r):
                if s.generated >= s.limit:
                    ending.append(s)
                else:
                    self._schedule(s)
        for s in due:
            if s.alive and s.generated < s.limit:
                self._schedule(s)
        if ending:
            self._finish(ending)
        return True

    def _advance_clock(self, work: StepWork) -> None:
        seconds = self.timer.seconds(
            work.tokens, work.attention_pairs, work.kv_tokens_read, work.logits, work.context_pairs
        )
        seconds += work.transfer_s  # loads finish before the forward pass reads them
        self.clock += seconds
        self.busy += seconds
        self.steps += 1

    def _full_step(self) -> bool:
        """A step that visits every running request, as the budget decides who runs (a prompt
        prefilled in chunks, or more sequences than the budget). Returns whether time passed."""
        now = self.steps
        for r in self.running:
            for s in r.seqs:
                s.sync(now)
        budget = self.budget
        prefills: list[tuple[LiveRequest, int]] = []
        decodes: list[DecodingSample] = []
        work = StepWork()
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.prefill_left:
                if budget:
                    k = min(r.prefill_left, budget)
                    budget -= k
                    prefills.append((r, k))
                    last = int(k == r.prefill_left)
                    work.add(k, prefill_pairs(r.kv, k), r.kv + k, last, context_pairs(r.kv, k))
                i += 1
                continue
            mine: list[DecodingSample] = []
            gone = False
            for s in r.seqs:
                if not budget:
                    break
                pos = s.kv_len
                if self._write_due(s) and not self._make_room(r, s):
                    gone = True
                    break
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
        timed = bool(prefills or decodes)
        if timed:
            self._advance_clock(work)
            for r, k in prefills:
                r.prefill_left -= k
                r.kv += k
                if not r.prefill_left:
                    self._start_decode(r)
            for s in decodes:
                s.generated += 1
            ending = [s for r in self.running for s in r.seqs if s.generated >= s.limit]
            for r in self.running:  # every sample is exact now, at the new step count
                for s in r.seqs:
                    s.synced = self.steps
            if ending:
                self._finish(ending)
        self._recount()
        return timed

    def _recount(self) -> None:
        """Every counter and the event queue, from the running requests (after a full step)."""
        now = self.steps
        self.queue = []
        n = kv = prefilling = 0
        for r in self.running:
            prefilling += bool(r.prefill_left)
            for s in r.seqs:
                s.synced = now
                n += 1
                kv += s.kv_len
                self._schedule(s)
        self.n_dec, self.kv_base, self.kv_step, self.prefilling = n, kv, now, prefilling
        self.logical = self.usage()[0]

    def _schedule(self, s: DecodingSample) -> None:
        """Queue ``s`` (exact at the current step count) at the step of its next write, or of
        its last token if that comes first."""
        bs = self.block_size
        pos = s.kv_len
        rest = pos % bs
        if s.must_flush or rest == 0:
            write = 0
        elif self.commit_writes:
            write = 0 if rest == bs - 1 else bs - 1 - rest
        else:  # caching nothing, only a new block matters
            write = bs - rest
        last = s.limit - s.generated - 1
        s.version += 1
        step = self.steps + (write if write < last else last)
        heapq.heappush(self.queue, (step, s.owner.rank, s.index, s.version, s))

    # ---- admission ---------------------------------------------------------------------------
    def _admit(self, budget: int, prefills: list[tuple[LiveRequest, int]], work: StepWork) -> None:
        acc, tiers, cache, counts = self.acc, self.tiers, self.cache, self.counts
        while self.waiting and budget:
            r = self.waiting[0]
            if self.live_seqs + r.req.n > self.max_seqs and self.running:
                break
            if self._known_short(r):
                if tiers is not None and tiers.feed is not None:
                    tiers.feed.flush()  # what a refused admission would have pooled first
                break
            adm = None
            try:
                if cache is None:
                    assert counts is not None
                    counts.admit(r.idx, len(r.tokens))
                elif tiers is None:  # the route's digests, unless outputs joined the prompt
                    digests = r.digests if len(r.tokens) == len(r.req.tokens) else None
                    adm = cache.admit(r.idx, r.tokens, r.req.namespace, digests=digests)
                else:
                    adm = tiers.admit(r.idx, r.tokens, r.req.namespace)
            except OutOfBlocksError as exc:
                self._note_short(r, exc)
                break
            except RequestTooLargeError:
                self.waiting.popleft()
                if r.recorded:
                    self.truncated += 1  # prompt plus recomputed output outgrew the cache
                else:
                    r.recorded = True
                    if acc is not None:
                        acc.record(r.idx, r.req, r.tokens.tobytes(), 0, False, 0, rejected=True)
                        self.prompt_tokens += len(r.req.tokens)
                continue
            self.waiting.popleft()
            self.epoch += 1
            self.admissions += 1
            cached_len = partial = host_tokens = pool_tokens = 0
            cow = False
            if adm is not None:
                assert cache is not None
                cached_len, partial, cow = adm.cached_len, adm.partial_tokens, adm.cow
                if tiers is not None:
                    hit = tiers.split(
                        bytes(cache.internals.states[r.idx].tokens), r.req.namespace, adm, r.digests
                    )
                    cached_len, partial = hit.cached_len, hit.partial_tokens
                    host_tokens, pool_tokens = hit.host_tokens, hit.pool_tokens
                    work.transfer_s += tiers.settings.load_seconds(hit.host_blocks, hit.pool_blocks)
            if not r.recorded:
                r.recorded = True
                if acc is not None and cache is not None:
                    r.prompt_bytes = bytes(cache.internals.states[r.idx].tokens)  # no 2nd copy
                    acc.record(
                        r.idx,
                        r.req,
                        r.prompt_bytes,
                        cached_len,
                        cow,
                        partial,
                        elsewhere=self.elsewhere(r) if self.elsewhere is not None else 0,
                        host_tokens=host_tokens,
                        pool_tokens=pool_tokens,
                    )
                    self.prompt_tokens += len(r.req.tokens)
                    self.hit_tokens += cached_len
            r.kv = cached_len
            r.prefill_left = len(r.tokens) - cached_len
            r.rank = self.next_rank
            self.next_rank += 1
            self.running.append(r)
            self.live_seqs += r.req.n
            self.logical += -(-len(r.tokens) // self.block_size)
            k = min(r.prefill_left, budget)
            budget -= k
            prefills.append((r, k))
            last = int(k == r.prefill_left)
            work.add(k, prefill_pairs(r.kv, k), r.kv + k, last, context_pairs(r.kv, k))

    def _note_short(self, r: LiveRequest, exc: OutOfBlocksError) -> None:
        """Remember the refused head and the blocks it lacked (1 when the error does not say)."""
        short = 1
        if self.counts is not None:
            short = self.counts.deficit
        elif exc.shortfall:
            short = exc.shortfall
        self.blocked = r
        self.blocked_epoch = self.epoch
        self.blocked_committed = self.committed
        self.blocked_short = short
        self.blocked_need = exc.needed
        self.blocked_admissions = self.admissions
        self.short_epoch = -1

    # ---- measurements -----------------------------------------------------------------------
    @property
    def ttft(self) -> list[float]:
        """Seconds to the first token, per request (NaN: not served yet)."""
        return self.times.ttft

    def figures(self) -> BenchmarkFigures:
        """Throughput and latency of the requests simulated so far."""
        return self.times.figures(self.busy)


def advance_replicas(sims: list[Simulator], until: float) -> None:
    """Step a fleet's replicas, the one with the earliest clock first, while any busy one is
    before ``until``: the earliest runs on while it stays the earliest (a tie goes to the lower
    replica), so the replicas' steps interleave as they would one step at a time."""
    while True:
        best = second = -1
        best_clock = second_clock = 0.0
        for k in range(len(sims)):
            sim = sims[k]
            clock = sim.clock
            if not (sim.running or sim.waiting) or clock >= until:
                continue
            if best < 0 or clock < best_clock:
                second, second_clock = best, best_clock
                best, best_clock = k, clock
            elif second < 0 or clock < second_clock:
                second, second_clock = k, clock
        if best < 0:
            return
        if second < 0:
            sims[best].run_steps(until, False)
        else:  # on while before the runner-up, or level with it and first in line
            sims[best].run_steps(second_clock, best < second)
