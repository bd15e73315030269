"""Counterfactual fleets: what the hit rate would have been with N-1, N+1 or 2N replicas, or
with another routing policy, answered by miniature shadow fleets fed a sample of the live
requests.

A request is in the sample when its first block's digest falls under a threshold (``rate``), so
every request of a sampled system prompt is in it and the sharing between them survives. Each
shadow is the real thing in miniature (Waldspurger et al., "Cache Modeling and Optimization
using Miniature Simulations", ATC'17): the router's own ``Router`` with the policy, over an
in-memory fleet index fed by the events of one ``CacheManager`` per shadow replica, each of
``capacity_blocks x rate`` blocks. The managers work on tokens, so each block's tokens are
derived from its digest (equal digests, equal tokens; the partial last block's are the
request's own), which keeps the sharing the digests show.

The miniature caches must hold a few prompts: ``capacity_blocks x rate`` below four sampled
prompts' blocks reads low (``too_small``), so long prompts want a higher rate, and each sampled
request runs every scenario's route and admission (about 0.5 ms per scenario for an 8k-token
prompt): the shadows are off unless ``whatif.counterfactual_rate`` is set.

A shadow sees no load: each request is released as soon as it is admitted, so the load terms
of ``least_loaded``, ``prefix_balanced`` and ``prefix_cost`` see an idle fleet, and their
numbers are what their cache choices give (said in ``/v1/whatif``).
"""

from __future__ import annotations

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
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.manager.cache_manager import CacheManager

FULL = 1 << 64
SHADOW_NAMESPACE = Namespace("shadow")  # the digests the tokens come from carry the real one
NOTE = (
    "miniature shadow fleets on a sample of requests (by first block); a shadow sees no load, "
    "so load-aware policies are judged by their cache choices"
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
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.requests = 0

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

    def offer(self, tokens: np.ndarray, digests: list[bytes]) -> None:
        """Route (on the request's shadow digests, computed once for every fleet), admit and
        release one sampled request."""
        decision = self.router.route(SHADOW_NAMESPACE, tokens, "r", digests=digests)
        mgr = self.managers[decision.replica]
        try:
            if mgr.can_admit(tokens, SHADOW_NAMESPACE):
                admission = mgr.admit("r", tokens, SHADOW_NAMESPACE)
                self.hit_tokens += admission.cached_len
                mgr.release("r")
        finally:
            self.router.release("r")
        self.prompt_tokens += len(tokens)
        self.requests += 1


class ShadowFleets:
    """Every scenario's shadow, fed the sampled requests (``offer``; thread-safe)."""

    def __init__(
        self, specs: Sequence[ReplicaSpec], policy: str, rate: float, min_blocks: int = 16
    ) -> None:
        self.rate = rate
        self._threshold = min(FULL, int(rate * FULL))
        self._lock = threading.Lock()
        self._fleets: list[_ShadowFleet] = []
        self.capacity = 0
        self.block_size = specs[0].block_size if specs else 16
        known = [s.capacity_blocks for s in specs if s.capacity_blocks > 0]
        if known:
            self.capacity = max(min_blocks, round(sum(known) / len(known) * rate))
            for scenario in scenarios(len(specs), policy):
                self._fleets.append(_ShadowFleet(scenario, self.capacity, self.block_size))
        self._partial = 0
        self._hasher = BlockHasher(self.block_size)
        self._blocks = 0  # full blocks of the sampled requests
        self._sampled = 0

    def offer(self, digests: Sequence[bytes], prompt_tokens: int) -> None:
        """A routed prompt (its full blocks' digests, root first); kept when its first block
        is in the sample."""
        if not self._fleets or not digests:
            return
        if int.from_bytes(digests[0][:8], "big") >= self._threshold:
            return
        tokens = self._tokens(digests, prompt_tokens)
        shadow = self._hasher.hash_prompt(tokens, SHADOW_NAMESPACE)
        with self._lock:
            self._blocks += len(shadow)
            self._sampled += 1
            for fleet in self._fleets:
                fleet.offer(tokens, shadow)

    def _tokens(self, digests: Sequence[bytes], prompt_tokens: int) -> np.ndarray:
        """Tokens that hash alike where the digests are alike: each block's from its digest,
        the partial last block's unique."""
        p = self.block_size
        words = np.frombuffer(b"".join(digests), dtype="<u4")  # 4 a digest
        reps = -(-p // 4)
        blocks = np.tile(words.reshape(-1, 4), (1, reps))[:, :p]
        blocks = blocks + np.arange(p, dtype=np.uint32)  # no two positions of a block alike
        tokens = (blocks & 0x3FFFFFFF).astype(np.int32).ravel()
        rest = prompt_tokens - len(tokens)
        if rest > 0:
            self._partial += 1
            tail = (np.arange(rest, dtype=np.int64) + self._partial * 7919) & 0x3FFFFFFF
            tokens = np.concatenate([tokens, tail.astype(np.int32)])
        return tokens

    def too_small(self) -> bool:
        """Whether the miniature caches hold fewer than four sampled prompts (of the mean
        length): then they evict what a real replica keeps, and the numbers read low."""
        with self._lock:
            return bool(self._sampled) and self.capacity < 4 * self._blocks / self._sampled

    def report(self) -> dict[str, Any]:
        """What ``/v1/whatif`` answers under ``counterfactuals``: the rate, the miniature
        replicas' size, whether they are too small, and each scenario's hit rate so far."""
        return {
            "rate": self.rate,
            "shadow_capacity_blocks": self.capacity,
            "sampled_requests": self._sampled,
            "too_small": self.too_small(),
            "note": NOTE,
            "scenarios": self.snapshot(),
        }

    @staticmethod
    def off() -> dict[str, Any]:
        """The ``counterfactuals`` answer with no shadows configured."""
        return {
            "rate": 0.0,
            "shadow_capacity_blocks": 0,
            "sampled_requests": 0,
            "too_small": False,
            "note": NOTE,
            "scenarios": [],
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """Each scenario's hit rate on the sample so far."""
        with self._lock:
            return [
                {
                    "scenario": f.scenario.name,
                    "replicas": f.scenario.replicas,
                    "policy": f.scenario.policy,
                    "requests": f.requests,
                    "token_hit_rate": round(f.hit_tokens / f.prompt_tokens, 6)
                    if f.prompt_tokens
                    else None,
                }
                for f in self._fleets
            ]
