"""Hit accounting of a replay: per-request rows, totals, miss causes, upper bound, top prefixes.

Definitions follow DESIGN.md: hit tokens are the manager's ``Admission.cached_len``; the misses of
a request (cold, capacity, isolation, tail, routing) add up to its prompt minus hit tokens.
"""

from __future__ import annotations

from array import array

from prefixcache.hashing import BlockHasher
from prefixcache.namespace import Namespace
from prefixcache.replay.prefixes import TopPrefixes
from prefixcache.replay.request import Request
from prefixcache.replay.shadow import Shadow
from prefixcache.replay.timeline import Timeline

TOP_PREFIXES = 10


class RequestLog:
    """One compact column per field of requests.csv (typed arrays, not Python objects)."""

    def __init__(self) -> None:
        self.request_id = array("q")
        self.arrival_s = array("d")
        self.namespace = array("i")
        self.prompt_tokens = array("q")
        self.hit_tokens = array("q")
        self.hit_blocks = array("q")
        self.miss_cold = array("q")
        self.miss_capacity = array("q")
        self.miss_isolation = array("q")
        self.miss_tail = array("q")
        self.output_tokens = array("q")
        self.ttft_s = array("d")  # serving mode only, filled in at the end
        self.ttft_nocache_s = array("d")

    def __len__(self) -> int:
        return len(self.request_id)


class Totals:
    __slots__ = (
        "attn_units",
        "capacity",
        "cold",
        "hit_blocks",
        "hit_tokens",
        "isolation",
        "output_tokens",
        "partial_copy_tokens",
        "prompt_blocks",
        "prompt_tokens",
        "rejected",
        "requests",
        "tail",
        "ub_blocks",
        "ub_tokens",
        "zero_hit",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


class Accountant:
    def __init__(
        self,
        block_size: int,
        hasher: BlockHasher,
        *,
        track_isolation: bool,
        record: bool = True,
    ) -> None:
        self.p = block_size
        self.hasher = hasher
        self.shadow = Shadow(block_size, track_isolation)
        self.totals = Totals()
        self.log = RequestLog() if record else None
        self.timeline = Timeline() if record else None
        self.namespaces: dict[Namespace, int] = {}
        self.prefixes = TopPrefixes(hasher, TOP_PREFIXES)
        # peaks: physical blocks in use (and fragmentation then), logical blocks
        self.physical_peak = 0
        self.fragmentation_at_peak = 0
        self.logical_peak = 0

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
    ) -> None:
        """Account one admission (or a rejection: nothing hit). ``cow``: the whole prompt was
        cached and its last token is recomputed in a copy; ``partial_tokens``: slots copied from
        a partially matching block (they are part of ``cached_len``)."""
        p = self.p
        t = len(req.tokens)
        f = t // p
        ns_index = self.namespaces.get(req.namespace)
        if ns_index is None:
            ns_index = self.namespaces[req.namespace] = len(self.namespaces)
        if cow:
            n, m = f, 0
        else:
            n, m = divmod(cached_len, p)
        anchor, u, v = self.shadow.observe(buf, f, req.namespace, n)
        if cow:
            cold = capacity = isolation = 0
            tail = 1
        else:
            tail = t - f * p - (m if n == f else 0)
            lost = m if n < f else 0  # slots of block n that were copied, not missed
            capacity = (u - n) * p - (lost if u > n else 0)
            isolation = (v - u) * p - (lost if u == n < v else 0)
            cold = (f - v) * p - (lost if v == n < f else 0)
        ub = u * p if u < f else (t - 1 if f * p == t else f * p)
        outputs = req.output_len * req.n

        tot = self.totals
        tot.requests += 1
        tot.prompt_tokens += t
        tot.hit_tokens += cached_len
        tot.prompt_blocks += f
        tot.hit_blocks += n
        tot.ub_tokens += ub if ub > cached_len else cached_len
        tot.ub_blocks += u
        tot.zero_hit += cached_len == 0
        tot.cold += cold
        tot.capacity += capacity
        tot.isolation += isolation
        tot.tail += tail
        tot.output_tokens += outputs
        tot.partial_copy_tokens += partial_tokens
        tot.rejected += rejected
        tot.attn_units += cached_len * (cached_len + 1) // 2
        if anchor is not None:
            self.prefixes.add(anchor, req.tokens, req.namespace, n, cached_len)

        log = self.log
        if log is not None:
            log.request_id.append(request_id)
            log.arrival_s.append(req.arrival_s)
            log.namespace.append(ns_index)
            log.prompt_tokens.append(t)
            log.hit_tokens.append(cached_len)
            log.hit_blocks.append(n)
            log.miss_cold.append(cold)
            log.miss_capacity.append(capacity)
            log.miss_isolation.append(isolation)
            log.miss_tail.append(tail)
            log.output_tokens.append(outputs)

    def note_output(self, req: Request, full_tokens_buf: bytes) -> None:
        """A sequence grew by its output, which a later request may reuse: the infinite cache
        holds those blocks too (its prompt's were just recorded)."""
        f = len(full_tokens_buf) // (4 * self.p)
        self.shadow.observe(full_tokens_buf, f, req.namespace, len(req.tokens) // self.p)

    def note_usage(self, physical: int, logical: int, fragmentation: int) -> None:
        if physical > self.physical_peak:
            self.physical_peak = physical
            self.fragmentation_at_peak = fragmentation
        if logical > self.logical_peak:
            self.logical_peak = logical

    def top_prefixes(self) -> list[dict[str, object]]:
        return self.prefixes.top()

    def rolling_hit_rate(self, window: int = 200) -> float:
        log = self.log
        if log is None or not len(log):
            return 0.0
        prompt = sum(log.prompt_tokens[-window:])
        return sum(log.hit_tokens[-window:]) / prompt if prompt else 0.0
