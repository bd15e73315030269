"""Embedding prefixcache as a runtime's cache manager: a minimal continuous-batching scheduler.

Requests share a system prompt. Each step is planned through the manager, then run, then ended:

1. plan: admit waiting requests while blocks allow; give each running request a block for its
   next token, preempting the newest request (``abort``) when the pool runs dry;
2. run: the forward pass stores the step's K/V, runs its copies, then attention;
3. end: ``end_step()``; finished requests are released (their blocks stay cached).

The model is faked (the "next token" is random); ``Engine`` shows where a runtime's K/V work goes.

    python examples/embedding.py [--blocks N]
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from prefixcache import CacheManager, Namespace


class Engine:
    """The runtime's side of the protocol. A real one keeps each request's slots and copies for
    the forward pass; ``step`` runs it: per layer, store K/V at the slots, ``kv.apply_copies``,
    then attention through ``mgr.block_tables``."""

    def __init__(self, mgr: CacheManager) -> None:
        self.mgr = mgr

    def admit(self, rid: Hashable, tokens: Sequence[int], ns: Namespace) -> int:
        adm = self.mgr.admit(rid, tokens, ns)  # adm.slot_mapping(), adm.copies: this step's work
        return adm.cached_len

    def append(self, rid: Hashable, new: Sequence[int]) -> None:
        self.mgr.append(rid, list(new))  # res.slots, res.copies: this step's work

    def abort(self, rid: Hashable) -> list[Hashable]:
        return self.mgr.abort(rid)  # the dropped requests leave this step's batch

    def release(self, rid: Hashable) -> None:
        self.mgr.release(rid)

    def step(self) -> None:
        # the forward pass runs here, then:
        self.mgr.end_step()


def main(num_blocks: int = 256, engine: Any = None, seed: int = 0) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    mgr = engine.mgr if engine is not None else CacheManager(num_blocks, 16, stepped=True)
    engine = engine if engine is not None else Engine(mgr)
    ns = Namespace(model="llama-3.1-8b", salt="tenant-a")
    system = rng.integers(0, 32_000, 200).tolist()
    waiting: list[tuple[str, list[int], int]] = [
        (
            f"req-{i}",
            system + rng.integers(0, 32_000, 40 + 7 * i).tolist(),
            int(rng.integers(8, 48)),
        )
        for i in range(24)
    ]
    tokens: dict[Hashable, list[int]] = {}  # what each running request holds, prompt included
    left: dict[Hashable, int] = {}  # tokens still to generate
    order: list[Hashable] = []  # running requests, oldest first: the newest is preempted first
    computed = prompt_tokens = steps = preempted = 0

    def requeue(dropped: list[Hashable]) -> None:
        nonlocal preempted
        for rid in dropped:
            preempted += 1
            order.remove(rid)
            waiting.insert(0, (str(rid), tokens.pop(rid), left.pop(rid)))

    while waiting or order:
        steps += 1
        new: list[Hashable] = []
        # 1a. admit while the pool allows (the scheduler's budget is blocks)
        while waiting and mgr.can_admit(waiting[0][1], ns):
            rid, prompt, max_new = waiting.pop(0)
            cached = engine.admit(rid, prompt, ns)
            computed += len(prompt) - cached
            prompt_tokens += len(prompt)
            tokens[rid], left[rid] = list(prompt), max_new
            order.append(rid)
            new.append(rid)
        if not order:
            raise SystemExit(f"a prompt does not fit in {num_blocks} blocks")
        # 1b. decode: requests that ran before this step get their next token's slot
        for rid in [r for r in order if r not in new]:
            token = int(rng.integers(0, 32_000))
            while rid in tokens and not mgr.can_append(rid, 1):
                victim = order[-1]  # preempt by recompute: the newest request
                requeue(engine.abort(victim))
                new = [r for r in new if r in tokens]
            if rid not in tokens:
                continue
            engine.append(rid, [token])
            tokens[rid].append(token)
            left[rid] -= 1
        # 2. the forward pass, then the end of the step
        engine.step()
        # 3. finished requests leave; their full blocks stay cached for the next ones
        for rid in [r for r in order if left[r] <= 0]:
            engine.release(rid)
            order.remove(rid)
            del tokens[rid], left[rid]
    mgr.check_integrity()
    counts = mgr.block_counts()
    return {
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "computed_prefill_tokens": computed,
        "preempted": preempted,
        "evicted_blocks": mgr.stats.evicted_blocks,
        "free": counts.free,
        "cached": counts.cached,
        "active": counts.active,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256, help="pool size in 16-token blocks")
    figures = main(parser.parse_args().blocks)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
