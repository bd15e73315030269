"""The shared-prompt workload of the manager benchmark, generated deterministically.

60% of requests are one of 8 system prompts (512-2,048 tokens) plus a unique 32-512-token
suffix; 40% belong to 64 multi-turn chats whose prompt is the chat's previous prompt, a 16-256
token reply and a 16-256-token new message.
"""

from __future__ import annotations

import numpy as np

VOCAB = 128_000


def shared_prompt_workload(num_requests: int = 2000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)

    def draw(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n, dtype=np.int64).astype("<i4")

    systems = [draw(int(rng.integers(512, 2049))) for _ in range(8)]
    chats: list[np.ndarray | None] = [None] * 64
    out = []
    for _ in range(num_requests):
        if rng.random() < 0.6:
            prompt = np.concatenate([systems[rng.integers(8)], draw(int(rng.integers(32, 513)))])
        else:
            c = int(rng.integers(64))
            turn = draw(int(rng.integers(16, 257)))
            prev = chats[c]
            prompt = (
                turn
                if prev is None
                else np.concatenate([prev, draw(int(rng.integers(16, 257))), turn])
            )
            chats[c] = prompt
        out.append(prompt)
    return out


def infinite_cache_hit_rate(prompts: list[np.ndarray], block_size: int) -> float:
    """Upper bound: full-block prefix hits against everything seen before, one-token rule."""
    seen: set[bytes] = set()
    hit = total = 0
    for p in prompts:
        n_full = len(p) // block_size
        matched, key = 0, b""
        keys = []
        for i in range(n_full):
            key = key + p[i * block_size : (i + 1) * block_size].tobytes()
            keys.append(hash(key))
        for k in keys:
            if k not in seen:
                break
            matched += 1
        hit += min(matched * block_size, len(p) - 1)
        total += len(p)
        seen.update(keys)
    return hit / total
