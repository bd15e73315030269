"""Embedding prefixcache as a runtime's cache manager: a minimal continuous-batching scheduler.

Requests share a system prompt. Each step admits waiting requests while blocks allow, then
decodes one token for every running request (the model is faked: the "next token" is random).
The K/V work a runtime would do is shown as comments at the exact places it belongs.

    python examples/embedding.py
"""

from __future__ import annotations

from collections import deque

import numpy as np

from prefixcache import CacheManager, Namespace, OutOfBlocksError


def main() -> None:
    rng = np.random.default_rng(0)
    mgr = CacheManager(num_blocks=256, block_size=16)
    ns = Namespace(model="llama-3.1-8b", salt="tenant-a")
    system = rng.integers(0, 32_000, 700).astype(np.int32)
    waiting = deque(
        (
            f"req-{i}",
            np.concatenate([system, rng.integers(0, 32_000, 40 + 7 * i).astype(np.int32)]),
            int(rng.integers(8, 48)),
        )
        for i in range(24)
    )
    running: dict[str, int] = {}  # request id -> tokens left to generate
    computed = prompt_tokens = steps = 0
    while waiting or running:
        steps += 1
        # 1. admit while the pool allows (the scheduler's budget is blocks)
        while waiting and mgr.can_admit(waiting[0][1], ns):
            rid, prompt, max_new = waiting.popleft()
            adm = mgr.admit(rid, prompt, ns)
            # runtime: prefill prompt[adm.cached_len:]; per layer, store its K/V at
            # adm.slot_mapping(), kv.apply_copies(adm.copies, layer), then attention through
            # mgr.block_tables([...])
            computed += len(prompt) - adm.cached_len
            prompt_tokens += len(prompt)
            running[rid] = max_new
        # 2. decode one token for every running request
        for rid in list(running):
            try:
                res = mgr.append(rid, int(rng.integers(0, 32_000)))
            except OutOfBlocksError:  # preempt by recompute: release, requeue the prompt
                tokens = mgr.token_ids(rid).copy()
                mgr.release(rid)
                waiting.appendleft((rid, tokens, running.pop(rid)))
                continue
            # runtime: per layer, store the new token's K/V at res.slots, then
            # kv.apply_copies(res.copies, layer), then attention
            assert len(res.slots) == 1
            running[rid] -= 1
            if running[rid] == 0:
                mgr.release(rid)  # its full blocks stay cached for the next request
                del running[rid]
    mgr.check_integrity()
    counts = mgr.block_counts()
    print(f"steps={steps} prompt_tokens={prompt_tokens} computed_prefill_tokens={computed}")
    print(
        f"token_hit_rate={mgr.stats.token_hit_rate:.3f} evicted_blocks={mgr.stats.evicted_blocks}"
    )
    print(f"blocks free={counts.free} cached={counts.cached} active={counts.active}")


if __name__ == "__main__":
    main()
