"""Counterfactual fleets: what the hit rate would have been with N-1, N+1 or 2N replicas, or
with another routing policy, answered by miniature shadow fleets fed a spatial sample of the
live requests' blocks.

A block is in the sample when its digest, read as a 64-bit number, falls under a threshold
(``rate``: the same test as the live curves'). Every routed prompt is cut down to its sampled
full blocks, root first, and that miniature prompt goes to the shadows. Digests chain, so two
prompts that share a prefix share exactly its sampled blocks, which lead both miniatures: the
sharing survives, at ``rate`` times the length, and the hits of hot prefixes and of
conversations are sampled block by block rather than a whole conversation in or out (the
variance of sampling by request: BENCHMARKS.md). Each shadow is the real thing in miniature
(Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations", ATC'17): the
router's own ``Router`` with the policy, over an in-memory fleet index fed by the events of one
``CacheManager`` per shadow replica, each of ``capacity_blocks x rate`` blocks. The managers
work on tokens, so each sampled block's tokens are derived from its digest (equal digests,
equal tokens), and one token of the request's own ends the miniature prompt (a prompt cached
whole still counts every sampled block as a hit).

The answer is the sampled blocks' hit share, corrected for a sample that holds more or fewer
blocks than the rate promises (each depth stratum against its true count, by what random
groups of the sample show: ``group_regression``), times the share of the routed prompt tokens
that sit in full blocks (a partial last block is never cached). The miniature caches must hold
a few prompts: below ``MIN_SHADOW_BLOCKS`` or four miniature prompts' blocks they read wrong
(``too_small``); and a prefix that many requests
share must have a sampled block, or the shadows route those requests apart
(``shared_prefix_unsampled``). Each request with a sampled block
costs a route and an admission per scenario, so the shadows are off unless
``whatif.counterfactual_rate`` is set.

A shadow sees no load: each request is released as soon as it is admitted, so the load terms
of ``least_loaded``, ``prefix_balanced`` and ``prefix_cost`` see an idle fleet, and their
numbers are what their cache choices give (said in ``/v1/whatif``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.policies import POLICIES
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.router import Router
from prefixcache.fleet.whatif.group_regression import GROUPS, stratified_share
from prefixcache.fleet.whatif.shards import STRATA, add_stratum_counts, sampled_depths, stratum
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.manager.cache_manager import CacheManager

FULL = 1 << 64
COLUMNS = STRATA * GROUPS  # a sampled block's column: its depth stratum and its random group
MIN_SHADOW_BLOCKS = 128  # a miniature replica below this is too coarse to trust
SHADOW_NAMESPACE = Namespace("shadow")  # the digests the tokens come from carry the real one
NOTE = (
    "miniature shadow fleets fed every request cut down to its sampled blocks; a shadow sees "
    "no load, so load-aware policies are judged by their cache choices"
)


class Scenario(NamedTuple):
    """One counterfactual: a fleet of ``replicas`` routed by ``policy``."""

    name: str
    replicas: int
    policy: str


def scenarios(replicas: int, policy: str) -> list[Scenario]:
    """The fleet as it is, N-1, N+1 and 2N replicas under its policy, and N replicas under each
    other policy."""
    out = [Scenario("as configured", replicas, policy)]
    for n, label in ((replicas - 1, "N-1"), (replicas + 1, "N+1"), (2 * replicas, "2N")):
        if n >= 1:
            out.append(Scenario(f"{label} replicas", n, policy))
    out += [Scenario(f"policy {p}", replicas, p) for p in POLICIES if p != policy]
    return out


class SampledPrompt(NamedTuple):
    """A routed prompt cut down to its sampled full blocks: what the shadows need of it."""

    sampled: list[bytes]  # the sampled blocks' digests, root first
    depths: list[int]  # their depths from the root
    blocks: int  # its full blocks
    first: bytes  # its first block's digest (b"" for none)


def sample_prompt(
    digests: Sequence[bytes], rate: float, picks: list[tuple[int, int]] | None = None
) -> SampledPrompt:
    """``digests`` (a prompt's full blocks, root first) cut down to the blocks sampled at
    ``rate``: a digest, read as a 64-bit number, under ``rate x 2**64`` (a first byte over the
    threshold's is passed over unread). ``picks``: the prompt's sampling hashes and depths
    already picked at this threshold or a higher one (``sampled_hashes``, deepest first), so
    the digests are not read again."""
    threshold = min(FULL, int(rate * FULL))
    if picks is None:
        depths = sampled_depths(digests, threshold)
    else:
        depths = [depth for h, depth in reversed(picks) if h < threshold]
    sampled = [digests[i] for i in depths]
    return SampledPrompt(sampled, depths, len(digests), digests[0] if digests else b"")


class _TopShare:
    """The largest share of the keys added that one key has, from a Space-Saving summary of
    ``slots`` counters (Metwally et al., 2005): over by at most ``1 / slots``, in bounded
    memory."""

    def __init__(self, slots: int = 16) -> None:
        self.slots = slots
        self.counts: dict[bytes, int] = {}
        self.total = 0

    def add(self, key: bytes) -> None:
        """Count one ``key``."""
        self.total += 1
        counts = self.counts
        if key in counts:
            counts[key] += 1
        elif len(counts) < self.slots:
            counts[key] = 1
        else:  # the least counted key gives its slot up, and its count
            least = min(counts, key=counts.__getitem__)
            counts[key] = counts.pop(least) + 1

    def share(self) -> float:
        """The top key's count over every key added (0 before any)."""
        return max(self.counts.values()) / self.total if self.total else 0.0


class _ShadowFleet:
    """One scenario in miniature."""

    def __init__(self, scenario: Scenario, capacity: int, block_size: int) -> None:
        self.scenario = scenario
        self.index = MemoryFleetIndex()
        names = [f"shadow-{i}" for i in range(scenario.replicas)]
        specs = [ReplicaSpec(n, SHADOW_NAMESPACE, block_size, capacity) for n in names]
        self.router = Router(self.index, specs, scenario.policy)
        self.managers: dict[str, CacheManager] = {}
        for name in names:
            mgr = CacheManager(capacity, block_size)
            mgr.add_listener(self._listener(name))
            self.managers[name] = mgr
        self.group_hits = np.zeros(COLUMNS, dtype=np.int64)  # sampled blocks hit, by column

    def _listener(self, name: str) -> Any:
        index = self.index

        def apply(event: object) -> None:
            if isinstance(event, BlockStored):
                index.store(name, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                index.remove(name, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.clear(name)

        return apply

    def offer(self, tokens: np.ndarray, digests: list[bytes], leading: np.ndarray) -> None:
        """Route (on the miniature prompt's digests, computed once for every fleet), admit and
        release one miniature prompt: its sampled blocks' tokens and one token of its own
        (``leading[k]``: how many of its first ``k`` blocks each column holds)."""
        decision = self.router.route(SHADOW_NAMESPACE, tokens, "r", digests=digests)
        mgr = self.managers[decision.replica]
        try:
            if mgr.can_admit(tokens, SHADOW_NAMESPACE):
                admission = mgr.admit("r", tokens, SHADOW_NAMESPACE)
                # a leading run of whole blocks: the last token never hits
                self.group_hits += leading[admission.cached_len // mgr.block_size]
                mgr.release("r")
        finally:
            self.router.release("r")


class ShadowFleets:
    """Every scenario's shadow, fed each routed prompt's sampled blocks (``offer``;
    thread-safe)."""

    def __init__(
        self, specs: Sequence[ReplicaSpec], policy: str, rate: float, min_blocks: int = 16
    ) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._fleets: list[_ShadowFleet] = []
        self.capacity = 0
        self.block_size = specs[0].block_size if specs else 16
        known = [s.capacity_blocks for s in specs if s.capacity_blocks > 0]
        if known:
            self.capacity = max(min_blocks, round(sum(known) / len(known) * rate))
            for scenario in scenarios(len(specs), policy):
                self._fleets.append(_ShadowFleet(scenario, self.capacity, self.block_size))
        self._hasher = BlockHasher(self.block_size)
        self._routed = 0  # requests offered
        self._prompt_tokens = 0  # their prompt tokens
        self._full_tokens = 0  # of those, the tokens in full blocks (what can hit)
        self._blocks = 0  # sampled full blocks
        self._sampled = 0  # requests with at least one: the miniature prompts made
        self._group_blocks = np.zeros(COLUMNS, dtype=np.int64)  # sampled blocks, by column
        self._stratum_blocks = [0] * STRATA  # every routed full block, by depth stratum
        self._first_blocks = _TopShare()  # the first block of each prompt with a sampled one
        self._first_sampled = _TopShare()  # the first sampled block of each

    def offer(self, digests: Sequence[bytes], prompt_tokens: int) -> None:
        """A routed prompt (its full blocks' digests, root first): its sampled blocks go to
        every shadow as one miniature prompt."""
        if self._fleets:
            self.offer_sampled(sample_prompt(digests, self.rate), prompt_tokens)

    def offer_sampled(self, prompt: SampledPrompt, prompt_tokens: int) -> None:
        """``offer`` with the prompt already cut down to its sampled blocks (``sample_prompt``
        at this rate: where the router runs, the rest elsewhere)."""
        if not self._fleets:
            return
        sampled = prompt.sampled
        with self._lock:
            self._routed += 1
            self._prompt_tokens += prompt_tokens
            self._full_tokens += prompt.blocks * self.block_size
            add_stratum_counts(self._stratum_blocks, prompt.blocks)
            if not sampled:
                return
            self._sampled += 1
            tokens = self._tokens(sampled, self._sampled)
            shadow = self._hasher.hash_prompt(tokens, SHADOW_NAMESPACE)
            groups = np.frombuffer(bytes(d[8] for d in sampled), dtype=np.uint8) % GROUPS
            strata = np.array([stratum(k) for k in prompt.depths], dtype=np.int64)
            leading = np.zeros((len(sampled) + 1, COLUMNS), dtype=np.int64)
            leading[np.arange(1, len(sampled) + 1), strata * GROUPS + groups] = 1
            np.cumsum(leading, axis=0, out=leading)  # each column's blocks among the first k
            self._group_blocks += leading[-1]
            self._first_blocks.add(prompt.first)
            self._first_sampled.add(sampled[0])
            self._blocks += len(sampled)
            for fleet in self._fleets:
                fleet.offer(tokens, shadow, leading)

    def _tokens(self, digests: Sequence[bytes], tail: int) -> np.ndarray:
        """Tokens that hash alike where the digests are alike (each block's from its digest),
        then one token no other miniature prompt has."""
        p = self.block_size
        words = np.frombuffer(b"".join(digests), dtype="<u4")  # 4 a digest
        reps = -(-p // 4)
        blocks = np.tile(words.reshape(-1, 4), (1, reps))[:, :p]
        blocks = blocks + np.arange(p, dtype=np.uint32)  # no two positions of a block alike
        tokens = (blocks & 0x3FFFFFFF).astype(np.int32).ravel()
        own = np.array([(tail * 7919) & 0x3FFFFFFF], dtype=np.int32)
        return np.concatenate([tokens, own])

    def too_small(self) -> bool:
        """Whether the miniature caches are too small to stand for the real ones: under
        ``MIN_SHADOW_BLOCKS``, or holding fewer than four miniature prompts (of the mean
        length); then they evict what a real replica keeps, and the numbers read wrong. Never
        at rate 1: the shadows are then the real size."""
        with self._lock:
            if not self._sampled or self.rate >= 1:
                return False
            return self.capacity < max(MIN_SHADOW_BLOCKS, 4 * self._blocks / self._sampled)

    def shared_prefix_unsampled(self) -> bool:
        """Whether a first block that many prompts share (a quarter more of them than share
        any one first sampled block) has its whole shared prefix outside the sample: then the
        miniature prompts lack what draws the real ones to one replica, the shadows route
        them apart, and their numbers are off by more than ``stderr`` says; raise the rate."""
        with self._lock:
            return self._first_blocks.share() - self._first_sampled.share() > 0.25

    def report(self) -> dict[str, Any]:
        """What ``/v1/whatif`` answers under ``counterfactuals``: the rate, the miniature
        replicas' size, the sample, whether the miniatures are too small, and each scenario's
        hit rate so far with its standard error."""
        with self._lock:
            sample = {
                "routed_requests": self._routed,
                "sampled_requests": self._sampled,
                "sampled_blocks": self._blocks,
            }
        return {
            "rate": self.rate,
            "shadow_capacity_blocks": self.capacity,
            **sample,
            "too_small": self.too_small(),
            "shared_prefix_unsampled": self.shared_prefix_unsampled(),
            "note": NOTE,
            "scenarios": self.snapshot(),
        }

    @staticmethod
    def off() -> dict[str, Any]:
        """The ``counterfactuals`` answer with no shadows configured."""
        return {
            "rate": 0.0,
            "shadow_capacity_blocks": 0,
            "routed_requests": 0,
            "sampled_requests": 0,
            "sampled_blocks": 0,
            "too_small": False,
            "shared_prefix_unsampled": False,
            "note": NOTE,
            "scenarios": [],
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """Each scenario's token hit rate so far, with a standard error: the sampled blocks'
        hit share, corrected for the sample's size (``stratified_share``), times the share of the
        routed prompt tokens in full blocks."""
        with self._lock:
            share = self._full_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
            # the blocks due in the sample, by depth stratum
            expected = [self.rate * n for n in self._stratum_blocks]
            blocks = self._group_blocks.reshape(STRATA, GROUPS).tolist()
            keep = math.sqrt(max(0.0, 1 - self.rate))  # no sampling error at rate 1
            rows = []
            for f in self._fleets:
                rate = stderr = None
                if self._blocks:
                    hit = f.group_hits.reshape(STRATA, GROUPS).tolist()
                    hits, error = stratified_share(hit, blocks, expected)
                    rate = round(hits * share, 6)
                    stderr = round(share * error * keep, 6)
                rows.append(
                    {
                        "scenario": f.scenario.name,
                        "replicas": f.scenario.replicas,
                        "policy": f.scenario.policy,
                        "requests": self._sampled,
                        "token_hit_rate": rate,
                        "stderr": stderr,
                    }
                )
            return rows
