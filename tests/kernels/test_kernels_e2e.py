"""Manager + PagedKVCache + store_kv + paged_attention: prefix sharing and copy-on-write end to end.

K/V of a token are a deterministic function of the token prefix up to it, as in a real model, so
a sequence's contiguous truth is computable without the cache and any reuse of the wrong block,
missed copy or overwritten shared block changes the kernel output. Unwritten cache slots are NaN.
Tolerance 1e-5 (fp32).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from prefixcache import CacheManager, Namespace, PagedKVCache
from prefixcache.kernels import interpreter_enabled, paged_attention, reference_attention, store_kv

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
HQ, HKV, D, P = 4, 2, 64, 16
NS = Namespace(model="tiny")


def prefix_kv(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [len, Hkv, D]: row i is seeded by a digest of tokens[: i + 1]."""
    ks, vs = [], []
    digest = hashlib.sha256()
    for tok in tokens:
        digest.update(tok.to_bytes(4, "little"))
        gen = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:7], "little"))
        kv = torch.randn(2, HKV, D, generator=gen)
        ks.append(kv[0])
        vs.append(kv[1])
    return torch.stack(ks).to(DEVICE), torch.stack(vs).to(DEVICE)


class Harness:
    """A one-layer 'model' whose K/V follow ``prefix_kv`` and whose queries are random."""

    def __init__(self, num_blocks: int = 24) -> None:
        self.mgr = CacheManager(num_blocks=num_blocks, block_size=P)
        self.kv = PagedKVCache(
            1, num_blocks, P, HKV, D, dtype=torch.float32, device=DEVICE, fill=float("nan")
        )
        self.tokens: dict[str, list[int]] = {}
        self.gen = torch.Generator().manual_seed(0)

    def write(self, rid: str, start: int, slots: np.ndarray, copies: list) -> None:
        """Store K/V of tokens[start:] of ``rid``, then run the step's copies."""
        k, v = prefix_kv(self.tokens[rid])
        slot_t = torch.from_numpy(slots).to(DEVICE)
        store_kv(k[start:], v[start:], self.kv.k[0], self.kv.v[0], slot_t)
        self.kv.apply_copies(copies)

    def attend(self, batch: list[tuple[str, int]]) -> None:
        """Attention for the last q_len tokens of each (request, q_len); checks vs contiguous."""
        q_lens = [q for _, q in batch]
        q = torch.randn(sum(q_lens), HQ, D, generator=self.gen).to(DEVICE)
        qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEVICE)
        seq_lens = [self.mgr.num_tokens(r) for r, _ in batch]
        out = paged_attention(
            q,
            self.kv.k[0],
            self.kv.v[0],
            self.mgr.block_tables([r for r, _ in batch], device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            qsl,
        )
        for i, (rid, _) in enumerate(batch):
            assert len(self.tokens[rid]) == seq_lens[i]
            k, v = prefix_kv(self.tokens[rid])
            rows = slice(int(qsl[i]), int(qsl[i + 1]))
            torch.testing.assert_close(
                out[rows], reference_attention(q[rows], k, v), atol=1e-5, rtol=1e-5
            )

    def admit(self, rid: str, tokens: list[int]) -> int:
        adm = self.mgr.admit(rid, tokens, NS)
        self.tokens[rid] = list(tokens)
        self.write(rid, adm.cached_len, adm.slot_mapping(), adm.copies)
        return adm.cached_len

    def append(self, rid: str, tok: int) -> list:
        res = self.mgr.append(rid, [tok])
        self.tokens[rid].append(tok)
        self.write(rid, len(self.tokens[rid]) - 1, res.slots, res.copies)
        return res.copies


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_shared_prefix_fork_and_copy_on_write(rng: np.random.Generator) -> None:
    h = Harness()
    system = rng.integers(0, 1000, 37).tolist()  # 2 full blocks + 5 tokens
    a = system + rng.integers(0, 1000, 15).tolist()  # 52 tokens: 3 full blocks
    b = system + rng.integers(0, 1000, 9).tolist()

    assert h.admit("a", a) == 0
    h.attend([("a", len(a))])  # prefill
    cached = h.admit("b", b)
    assert cached >= 2 * P  # shared full blocks (plus partially copied slots)
    assert h.mgr.block_table("b")[:2] == h.mgr.block_table("a")[:2]
    h.attend([("a", 1), ("b", len(b) - cached)])  # decode-only row + extend over a shared prefix

    h.mgr.fork("a", "c")
    h.tokens["c"] = list(h.tokens["a"])
    assert h.mgr.block_table("c") == h.mgr.block_table("a")  # shares the partial block too
    copies = h.append("a", 1) + h.append("c", 2)  # diverge inside the shared partial block
    assert len(copies) == 1
    assert h.mgr.block_table("c")[-1] != h.mgr.block_table("a")[-1]
    h.attend([("a", 1), ("b", 1), ("c", 1)])

    for step in range(P + 3):  # cross block boundaries while other sequences keep reading
        for rid in ("a", "b", "c"):
            h.append(rid, int(rng.integers(0, 1000)) + step)
        h.attend([("c", 1), ("a", 1), ("b", 1)])
    for rid in ("a", "b", "c"):
        h.mgr.release(rid)


def test_fully_cached_prompt_recomputes_only_the_last_token(rng: np.random.Generator) -> None:
    h = Harness()
    prompt = rng.integers(0, 1000, 2 * P).tolist()  # exactly 2 full blocks
    h.admit("first", prompt)
    h.attend([("first", len(prompt))])
    h.mgr.release("first")
    assert h.admit("again", prompt) == len(prompt) - 1  # CoW copy of the last block
    h.attend([("again", 1)])
    h.append("again", 7)
    h.attend([("again", 1)])
