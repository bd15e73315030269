"""Hit accounting of a replay: per-request rows, totals, miss causes, upper bound, top prefixes.

Hit tokens are the manager's ``Admission.cached_len``; the misses of a request (cold, capacity,
isolation, tail, routing) add up to its prompt minus hit tokens (docs/architecture.md).

Next to the real cache runs a shadow: an infinite cache with the same block size, which would hit
every full block whose prefix it has seen in the same namespace. Keeping the set of prefix keys
per namespace (and, when several namespaces occur, a namespace-free set) answers that in
O(blocks) per request, and tells apart blocks the real cache lost to eviction (seen here) from
blocks it could never have had (cold) and blocks cached only under another namespace
(isolation).

The shadow's keys are 64-bit fingerprints of every full-block prefix: ``key_k = xxh3_64(tokens
of blocks 0..k, seed)`` with the seed from the namespace, or a fixed neutral seed for the
namespace-free keys. A streaming hash state yields the keys block after block, and starting it at
block ``k`` costs one bulk update, so a prefix the cache already matched is never hashed block by
block. A 64-bit collision (about 2**-64 per pair) could only shift the upper bound or a miss
cause by one block; the cache itself never sees these keys. The keys live in a ``KeySet`` (11-21
bytes a unique block), the one part of a replay's memory that grows with the trace; a replay
without the upper bound keeps none.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash
from xxhash import xxh3_64

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.stats import BlockCounts
from prefixcache.replay.sim.keyset import KeySet
from prefixcache.replay.sim.request_rows import RequestRows
from prefixcache.replay.workload.request import Request

TOP_PREFIXES = 10
NEUTRAL_SEED = 0x5EED
_h64 = xxhash.xxh3_64_intdigest
_TABLE_LIMIT = 100_000  # distinct prefixes kept; beyond it the half that saved least is dropped


@dataclass(slots=True)
class Totals:
    """Sums over every request of a replay (``ub_*``: the infinite cache's hits)."""

    attn_units: int = 0
    capacity: int = 0
    cold: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    isolation: int = 0
    output_tokens: int = 0
    partial_copy_tokens: int = 0
    prompt_blocks: int = 0
    prompt_tokens: int = 0
    rejected: int = 0
    requests: int = 0
    routing: int = 0
    tail: int = 0
    ub_blocks: int = 0
    ub_tokens: int = 0
    zero_hit: int = 0
    host_hit_tokens: int = 0  # of hit_tokens: loaded from the host tier
    pool_hit_tokens: int = 0  # of hit_tokens: loaded from the shared pool


class Accountant:
    def __init__(
        self,
        block_size: int,
        hasher: BlockHasher,
        *,
        track_isolation: bool,
        record: bool = True,
        upper_bound: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.shadow = Shadow(block_size, track_isolation, enabled=upper_bound)
        self.totals = Totals()
        self.log = RequestRows() if record else None
        self.timeline = Timeline() if record else None
        self.namespaces: dict[Namespace, int] = {}
        self.prefixes = TopPrefixes(hasher, TOP_PREFIXES)
        # peaks: physical blocks in use (and fragmentation then), logical blocks
        self.physical_peak = 0
        self.fragmentation_at_peak = 0
        self.logical_peak = 0
        self.deferred: DeferredShadow | None = None  # the shadow answers elsewhere, later

    def defer_shadow(self, sink: Callable[[bytes, int], None], batch: int = 256) -> None:
        """From now on hand the shadow's observations to ``sink`` (``DeferredShadow``) instead
        of making them here, ``batch`` observations at a time; ``settle_shadow`` adds what the
        shadow answers. Only with the upper bound on (without it the shadow keeps nothing and
        costs next to nothing)."""
        assert self.shadow.enabled and self.deferred is None
        self.deferred = DeferredShadow(sink, len(self.log) if self.log is not None else 0, batch)

    def settle_shadow(self, answers: ShadowAnswers) -> None:
        """Add the misses the shadow split for the deferred records (in the order recorded):
        to the totals, and to their rows."""
        deferred = self.deferred
        assert deferred is not None
        cols = np.frombuffer(answers.misses, dtype=np.int64).reshape(-1, len(MISS_COLUMNS))
        if len(cols) != deferred.records:
            raise ValueError(
                f"the shadow answered {len(cols)} records; {deferred.records} were deferred"
            )
        tot = self.totals
        tot.cold += int(cols[:, 0].sum())
        tot.capacity += int(cols[:, 1].sum())
        tot.isolation += int(cols[:, 2].sum())
        tot.routing += int(cols[:, 3].sum())
        tot.ub_tokens += answers.ub_tokens
        tot.ub_blocks += answers.ub_blocks
        if self.log is not None:
            self.log.set_columns(
                deferred.first_row, {name: cols[:, k] for k, name in enumerate(MISS_COLUMNS)}
            )
        self.deferred = None

    def record(
        self,
        request_id: int,
        req: Request,
        buf: bytes,
        cached_len: int,
        cow: bool,
        partial_tokens: int,
        *,
        rejected: bool = False,
        elsewhere: int = 0,
        host_tokens: int = 0,
        pool_tokens: int = 0,
    ) -> None:
        """Account one admission (or a rejection: nothing hit). ``cow``: the whole prompt was
        cached and its last token is recomputed in a copy; ``partial_tokens``: slots copied from
        a partially matching block (they are part of ``cached_len``); ``elsewhere``: leading
        full blocks of the prompt another replica of a fleet holds (0 for one cache). Blocks
        seen before that another replica holds and this cache missed are routing misses, taken
        out of the capacity misses. ``host_tokens`` / ``pool_tokens``: the part of
        ``cached_len`` loaded from the host tier / the pool (the rest matched on the GPU)."""
        p = self.block_size
        arrival_s, tokens, output_len, namespace, samples = req[:5]
        t = len(tokens)
        f = t // p
        ns_index = self.namespaces.get(namespace)
        if ns_index is None:
            ns_index = self.namespaces[namespace] = len(self.namespaces)
        n = f if cow else cached_len // p
        tail = 1 if cow else t - f * p - (cached_len - n * p if n == f else 0)
        outputs = output_len * samples

        tot = self.totals
        deferred = self.deferred
        if deferred is None:
            anchor, u, v = self.shadow.observe(buf, f, namespace, n)
            cold, capacity, isolation, routing, ub = split_misses(
                p, t, cached_len, cow, u, v, elsewhere
            )
            tot.cold += cold
            tot.capacity += capacity
            tot.isolation += isolation
            tot.routing += routing
            tot.ub_tokens += ub
            tot.ub_blocks += u
        else:  # the shadow answers later, elsewhere: settle_shadow adds these
            anchor = self.shadow.anchor(buf, namespace, n)
            deferred.prompt(
                request_id,
                cached_len,
                cow,
                elsewhere,
                not rejected and req.output_tokens is not None,
            )
            cold = capacity = isolation = routing = 0
        tot.requests += 1
        tot.prompt_tokens += t
        tot.hit_tokens += cached_len
        tot.prompt_blocks += f
        tot.hit_blocks += n
        tot.zero_hit += cached_len == 0
        tot.host_hit_tokens += host_tokens
        tot.pool_hit_tokens += pool_tokens
        tot.tail += tail
        tot.output_tokens += outputs
        tot.partial_copy_tokens += partial_tokens
        tot.rejected += rejected
        tot.attn_units += cached_len * (cached_len + 1) // 2
        if anchor is not None:
            self.prefixes.add(anchor, tokens, namespace, n, cached_len)

        log = self.log
        if log is not None:
            log.add(
                arrival_s,
                (
                    request_id,
                    ns_index,
                    t,
                    cached_len,
                    f,
                    n,
                    cold,
                    capacity,
                    isolation,
                    tail,
                    routing,
                    outputs,
                ),
            )

    def note_output(self, request_id: int, req: Request, full_tokens_buf: bytes) -> None:
        """A sequence grew by its output (``full_tokens_buf``: the prompt, then the first
        output tokens of ``req.output_tokens``), which a later request may reuse: the infinite
        cache holds those blocks too (its prompt's were just recorded)."""
        if self.deferred is not None:
            self.deferred.output(request_id, len(full_tokens_buf) // 4 - len(req.tokens))
            return
        f = len(full_tokens_buf) // (4 * self.block_size)
        self.shadow.observe(full_tokens_buf, f, req.namespace, len(req.tokens) // self.block_size)

    def note_usage(self, physical: int, logical: int, fragmentation: int) -> None:
        if physical > self.physical_peak:
            self.physical_peak = physical
            self.fragmentation_at_peak = fragmentation
        if logical > self.logical_peak:
            self.logical_peak = logical

    def sample_timeline(
        self, steps: int, clock: float | None, counts: BlockCounts, evicted: int, final: bool
    ) -> None:
        """A timeline row (blocks per state, evictions and hits so far) when one is due, and
        always for the ``final`` one. ``clock``: the simulated time in seconds, or None to mark
        the row by ``steps`` (a sequential replay's request index, written as an integer)."""
        timeline = self.timeline
        if timeline is None or not (final or timeline.due(steps)):
            return
        tot = self.totals
        row = TimelineRow(
            steps if clock is None else round(clock, 9),
            counts.active,
            counts.cached,
            counts.free,
            evicted,
            tot.prompt_tokens,
            tot.hit_tokens,
            self.rolling_hit_rate(),
        )
        if final:
            timeline.finish(steps, row)
        else:
            timeline.add(steps, row)

    def top_prefixes(self) -> list[dict[str, object]]:
        return self.prefixes.top()

    def rolling_hit_rate(self) -> float:
        """Token hit rate of the latest requests (0 when rows are not recorded)."""
        return self.log.rolling_hit_rate() if self.log is not None else 0.0


# ---- the infinite cache next to the real one --------------------------------------------------


class NamespaceSeeds:
    """The key seed of each namespace, cached."""

    def __init__(self) -> None:
        self.known: dict[Namespace, int] = {}  # the seeds computed so far

    def __call__(self, namespace: Namespace) -> int:
        seed = self.known.get(namespace)
        if seed is None:
            seed = _h64(b"prefixcache/replay/ns\x00" + namespace.canonical_bytes())
            self.known[namespace] = seed
        return seed


class ShadowMatch(NamedTuple):
    """What the infinite cache knew of a sequence's full-block prefixes before it was observed."""

    anchor: int | None  # the key of the last block the real cache matched; None when none
    seen: int  # leading blocks seen before in this namespace
    seen_any: int  # leading blocks seen before in any namespace (>= seen; == seen untracked)


class Shadow:
    """The full-block prefixes a replay has seen so far, per namespace and namespace-free.

    ``enabled=False`` keeps nothing: every sequence is reported as seen exactly as far as the
    real cache matched it (no upper bound, no capacity or isolation misses), in constant memory.
    """

    def __init__(self, block_size: int, track_isolation: bool, *, enabled: bool = True) -> None:
        self.block_bytes = 4 * block_size
        self.track_isolation = track_isolation and enabled
        self.enabled = enabled
        self.seen = KeySet()  # prefix keys seen, namespace in the key
        self.seen_neutral = KeySet()  # the same prefixes without the namespace
        self.seed = NamespaceSeeds()

    @property
    def unique_blocks(self) -> int:
        """Blocks an infinite cache would hold now."""
        return len(self.seen)

    def observe(
        self, buf: bytes, num_blocks: int, namespace: Namespace, known: int = 0
    ) -> ShadowMatch:
        """Look up, then remember, the full-block prefixes of a sequence whose first ``known``
        blocks are known to be seen (the cache just matched them)."""
        bb = self.block_bytes
        seed = self.seed.known.get(namespace)
        if seed is None:
            seed = self.seed(namespace)
        state = xxh3_64(buf[: known * bb], seed)
        anchor = state.intdigest() if known else None
        if not self.enabled:
            return ShadowMatch(anchor, known, known)
        u = _extend(state, buf, bb, known, num_blocks, self.seen)
        v = u
        if self.track_isolation and u < num_blocks:
            neutral = xxh3_64(buf[: u * bb], NEUTRAL_SEED)
            v = _extend(neutral, buf, bb, u, num_blocks, self.seen_neutral)
        return ShadowMatch(anchor, u, v)

    def anchor(self, buf: bytes, namespace: Namespace, known: int) -> int | None:
        """``observe(...).anchor`` alone: the key of the first ``known`` blocks (None: none),
        remembering nothing."""
        if not known:
            return None
        seed = self.seed.known.get(namespace)
        if seed is None:
            seed = self.seed(namespace)
        return _h64(buf[: known * self.block_bytes], seed)


def split_misses(
    p: int, t: int, cached_len: int, cow: bool, u: int, v: int, elsewhere: int
) -> tuple[int, int, int, int, int]:
    """A request's missed tokens by cause, from what the shadow knew (``u`` / ``v`` leading
    blocks seen before in its namespace / in any): ``(cold, capacity, isolation, routing,
    ub)``, ``ub`` being the infinite cache's hit tokens (at least ``cached_len``). ``p``: the
    block size; ``t``: prompt tokens; ``elsewhere``: leading blocks another replica holds."""
    f = t // p
    ub = u * p if u < f else (t - 1 if f * p == t else f * p)
    if ub < cached_len:
        ub = cached_len
    if cow:
        return 0, 0, 0, 0, ub
    n, m = divmod(cached_len, p)
    lost = m if n < f else 0  # slots of block n that were copied, not missed
    capacity = (u - n) * p - (lost if u > n else 0)
    isolation = (v - u) * p - (lost if u == n < v else 0)
    cold = (f - v) * p - (lost if v == n < f else 0)
    routing = 0
    w = min(elsewhere, u)
    if w > n:  # blocks n..w-1 were on another replica: the route missed them
        routing = (w - n) * p - lost
        capacity = (u - w) * p
    return cold, capacity, isolation, routing, ub


# the row columns the shadow settles, in ``ShadowAnswers.misses`` order
MISS_COLUMNS = ("miss_cold", "miss_capacity", "miss_isolation", "miss_routing")


class ShadowAnswers(NamedTuple):
    """What a shadow run elsewhere answered for the deferred records, in their order."""

    misses: bytes  # int64 per record and ``MISS_COLUMNS`` entry, row after row
    ub_tokens: int  # the infinite cache's hit tokens, summed
    ub_blocks: int  # its hit blocks, summed


class DeferredShadow:
    """The shadow's observations, in order, handed to ``sink`` in batches (int64 triples: see
    ``prompt`` and ``output``) for a shadow elsewhere to make (``replay.sim.shadow_feed``),
    each with the number of requests the pass has read of its workload by then (``read_to``),
    so a pass reading the same workload elsewhere can keep pace."""

    def __init__(self, sink: Callable[[bytes, int], None], first_row: int, batch: int) -> None:
        self.sink = sink
        self.batch = 3 * batch  # int64s a batch
        self.first_row = first_row  # the first deferred record's row
        self.records = 0
        self.events = array("q")
        self.read = self.sent_read = 0  # requests read by the pass; as last handed on

    def prompt(
        self, request_id: int, cached_len: int, cow: bool, elsewhere: int, expects_output: bool
    ) -> None:
        """A record: ``(2 * request_id, cached_len, 4 * elsewhere + 2 * expects_output +
        cow)``; ``expects_output``: an ``output`` of it may follow."""
        self.records += 1
        self.events.extend((2 * request_id, cached_len, 4 * elsewhere + 2 * expects_output + cow))
        if len(self.events) >= self.batch:
            self.flush()

    def output(self, request_id: int, outputs: int) -> None:
        """A sequence grew by ``outputs`` tokens of its given output: ``(2 * request_id + 1,
        outputs, 0)``."""
        self.events.extend((2 * request_id + 1, outputs, 0))
        if len(self.events) >= self.batch:
            self.flush()

    def read_to(self, read: int) -> None:
        """The pass has read ``read`` requests of its workload (handed on once it read a
        batch's worth more, with or without observations)."""
        self.read = read
        if read - self.sent_read >= self.batch // 3:
            self.flush()

    def flush(self) -> None:
        """Hand the batch so far, and the requests read, to the sink."""
        self.sink(self.events.tobytes(), self.read)
        self.sent_read = self.read
        self.events = array("q")


def _extend(state: xxh3_64, buf: bytes, bb: int, start: int, end: int, seen: KeySet) -> int:
    """Walk blocks ``start .. end-1`` with a hash state holding the blocks before ``start``:
    count the leading keys already seen, adding the others (a chain past an unseen block is
    unseen)."""
    update, digest = state.update, state.intdigest
    keys = []
    for offset in range(start * bb, end * bb, bb):
        update(buf[offset : offset + bb])
        keys.append(digest())
    return start + seen.add_chain(keys)


# ---- the prefixes that saved the most tokens --------------------------------------------------
#
# Every request with a hit counts toward the prefix it matched down to. Only the current leaders
# are named by the cache's own digest (of the prefix's last block), computed when a prefix joins
# them, so naming costs nothing for the long tail of prefixes seen once.


class TopPrefixes:
    """Tokens saved per deepest matched prefix; the ``k`` leaders named by their digest."""

    def __init__(self, hasher: BlockHasher, k: int = 10) -> None:
        self.hasher, self.k = hasher, k
        self._table: dict[int, list[Any]] = {}  # key -> [name, depth, requests, tokens saved]
        self._top: dict[int, int] = {}  # the k largest savings, always current
        self._floor = 0  # the smallest of them once there are k

    def add(self, key: int, tokens: np.ndarray, ns: Namespace, depth: int, saved: int) -> None:
        entry = self._table.get(key)
        if entry is None:
            entry = self._table[key] = [None, depth, 0, 0]
            if len(self._table) > _TABLE_LIMIT:
                self._prune()
        entry[2] += 1
        total = entry[3] = entry[3] + saved
        top = self._top
        if key in top or len(top) < self.k:
            top[key] = total
        elif total > self._floor:
            del top[min(top, key=top.__getitem__)]
            top[key] = total
        else:
            return
        if entry[0] is None:
            digests = self.hasher.hash_blocks(tokens, self.hasher.seed(ns), 0, depth)
            entry[0] = digests[-1][:8].hex()
        if len(top) == self.k:
            self._floor = min(top.values())

    def _prune(self) -> None:
        keep = dict(heapq.nlargest(_TABLE_LIMIT // 2, self._table.items(), key=lambda kv: kv[1][3]))
        keep.update((k, self._table[k]) for k in self._top)
        self._table = keep

    def top(self) -> list[dict[str, Any]]:
        entries = sorted((self._table[k] for k in self._top), key=lambda e: (-e[3], -e[2]))
        return [
            {"prefix_id": e[0], "depth_blocks": e[1], "requests": e[2], "tokens_saved": e[3]}
            for e in entries
        ]


# ---- timeline.csv rows ------------------------------------------------------------------------


class TimelineRow(NamedTuple):
    """One row of timeline.csv (``run_format.TIMELINE_COLUMNS``)."""

    t: int | float  # request index (sequential) or simulated seconds (serving)
    blocks_active: int
    blocks_cached: int
    blocks_free: int
    evicted_blocks_cum: int
    prompt_tokens_cum: int
    hit_tokens_cum: int
    rolling_token_hit_rate: float


class Timeline:
    """Rows sampled evenly without knowing the length of the replay in advance.

    Rows are taken every ``every`` ticks (requests or steps); whenever twice the target count is
    reached, every other row is dropped and the interval doubles, so a replay of any length ends
    with between ``target`` and ``2 * target`` evenly spaced rows, plus the final state.
    """

    def __init__(self, target: int = 1000) -> None:
        self.target = target
        self.every = 1
        self.rows: list[TimelineRow] = []
        self._last_tick = -1

    def due(self, tick: int) -> bool:
        return tick % self.every == 0

    def add(self, tick: int, row: TimelineRow) -> None:
        self._last_tick = tick
        self.rows.append(row)
        if len(self.rows) >= 2 * self.target:
            self.rows = self.rows[::2]
            self.every *= 2
            if self.rows[-1] is not row:
                self._last_tick = -1

    def finish(self, tick: int, row: TimelineRow) -> None:
        """The state at the end of the replay, always the last row."""
        if tick == self._last_tick and self.rows:
            self.rows[-1] = row
        else:
            self.rows.append(row)
        self._last_tick = tick
