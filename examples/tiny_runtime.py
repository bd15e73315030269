"""A tiny inference runtime on prefixcache: prefix-cached prefill and decode with paged attention.

A random-weight decoder-only transformer (2 layers, GQA, RoPE) generates greedily for a batch of
prompts that share a system prompt. Every step admits at most one new prompt (prefill, or extend
over its cached prefix) and decodes all running requests in one packed varlen batch; K/V go
through ``store_kv`` into a ``PagedKVCache`` and attention reads them back through the manager's
block tables. Run once with prefix caching and once without: the tokens and logits agree (fp32,
max |diff| <= 1e-4) while the cached run computes far fewer prefill tokens.

    python examples/tiny_runtime.py [--backend auto|torch|triton] [--interpret] [--host-blocks N]

``--host-blocks N`` runs a workload that a small GPU pool cannot keep cached (prompts rotate over
several system prompts) with a host tier of N blocks: evicted blocks are offloaded to host memory
and loaded back on a hit, before the forward pass (offloads, then loads; each layer waits for its
transfers before its K/V store). Tokens and logits still match the uncached run, and fewer
prefill tokens are computed than with the GPU pool alone.

On CPU, ``auto`` uses the torch reference attention unless TRITON_INTERPRET=1 (``--interpret``),
which runs the Triton kernels in the interpreter; on CUDA it runs the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixcache import CacheManager, ConfigError, Copy, Namespace, PagedKVCache
from prefixcache.kernels import Backend, paged_attention, store_kv
from prefixcache.store.backend import KVBlockStore
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.from_url import open_store

LOGIT_TOL = 1e-4


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 128
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 256
    rope_theta: float = 10000.0


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyDecoder:
    """Pre-norm decoder with tied embeddings; attention sees K/V only through the paged cache."""

    def __init__(self, cfg: ModelConfig, *, seed: int = 0, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(device)

        self.cfg = cfg
        self.embed = torch.randn(cfg.vocab, cfg.d_model, generator=gen).to(device)
        qkv = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.layers = [
            (
                w(cfg.d_model, qkv),
                w(cfg.num_q_heads * cfg.head_dim, cfg.d_model),
                w(cfg.d_model, cfg.ffn),
                w(cfg.ffn, cfg.d_model),
            )
            for _ in range(cfg.num_layers)
        ]
        half = cfg.head_dim // 2
        self.inv_freq = (cfg.rope_theta ** (-torch.arange(half) / half)).to(device)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE; x [T, H, D], positions [T]."""
        angles = positions[:, None].float() * self.inv_freq  # [T, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: PagedKVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        backend: Backend,
        copies: list[Copy],
    ) -> torch.Tensor:
        """One packed forward over new tokens; returns logits [B, vocab] of each last token."""
        c = self.cfg
        hq, hkv, d = c.num_q_heads, c.num_kv_heads, c.head_dim
        x = self.embed[ids]  # [T, d_model]
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(self.layers):
            q, k, v = (_rms(x) @ w_qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
            q = self._rope(q.reshape(-1, hq, d), positions)  # [T, Hq, D]
            k = self._rope(k.reshape(-1, hkv, d), positions)  # [T, Hkv, D]
            v = v.reshape(-1, hkv, d)
            kv.wait_transfers(layer)  # this layer's offloads and loads are done
            store_kv(k, v, kv.k[layer], kv.v[layer], slots, backend=backend)
            # the step's copies go after the store: their sources may be blocks this very step
            # writes (indexed by an earlier admission of the step); copied and written slots
            # never overlap
            kv.apply_copies(copies, layer)
            attn = paged_attention(
                q,
                kv.k[layer],
                kv.v[layer],
                block_tables,
                seq_lens,
                query_start_loc,
                backend=backend,
            )
            x = x + attn.reshape(-1, hq * d) @ w_o
            x = x + torch.nn.functional.silu(_rms(x) @ w_up) @ w_down
        last = query_start_loc[1:].long() - 1
        return _rms(x[last]) @ self.embed.T


@dataclass
class RunResult:
    """Generated tokens and last-token logits per request, and the prefill work done."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)  # per request: prompt hits
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    requeued: int = 0  # requests aborted because a store load failed, and admitted again


def _abort(mgr: CacheManager, rid: Hashable) -> list[str]:
    """Abort ``rid`` if it is still live; returns every request dropped."""
    return [str(d) for d in mgr.abort(rid)] if rid in mgr.requests else []


def _pack(
    rows: list[tuple[str, list[int], int, np.ndarray]], mgr: CacheManager, device: str
) -> dict[str, torch.Tensor]:
    """Kernel inputs for one step from (request, new token ids, first position, slots) rows."""
    lens = [len(ids) for _, ids, _, _ in rows]
    rids = [rid for rid, *_ in rows]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {
        "ids": torch.tensor([t for _, ids, _, _ in rows for t in ids], device=device),
        "positions": torch.cat(
            [torch.arange(start, start + len(ids)) for _, ids, start, _ in rows]
        ).to(device),
        "slots": torch.from_numpy(np.concatenate([slots for *_, slots in rows])).to(device),
        "block_tables": mgr.block_tables(rids, device=device),
        "seq_lens": i32([mgr.num_tokens(rid) for rid in rids]),
        "query_start_loc": i32([0, *np.cumsum(lens).tolist()]),
    }


def run_requests(
    model: TinyDecoder,
    mgr: CacheManager,
    kv: PagedKVCache,
    ns: Namespace,
    prompts: dict[str, list[int]],
    *,
    max_new_tokens: int,
    backend: Backend = "auto",
    device: str = "cpu",
    after_step: Callable[[], object] | None = None,
    store: KVStoreConnector | None = None,
) -> RunResult:
    """Continuous batching over ``mgr`` and ``kv``: per step, admit every waiting prompt that
    fits, decode the rest, run the forward pass, then ``end_step()`` and ``after_step()`` (e.g.
    a KV event publisher's ``flush``). Finished requests are released, so their full blocks stay
    cached for later calls on the same manager.

    Prompts admitted in the same step share blocks that step is still writing: per layer, the
    model stores all new K/V before attention reads any, and runs the copies in between. With a
    host tier the step's transfers start before the forward pass and the step ends with
    ``end_step()`` (a load's host slot is reused only after it). With a shared ``store`` (the
    manager's ``store=``), its loads run before the forward pass too; a request whose block the
    store no longer serves is aborted (with what relied on it) and requeued, and the step's
    computed blocks are written through right after ``end_step()``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    result = RunResult()
    waiting: list[str] = list(prompts)
    running: list[str] = []
    while waiting or running:
        rows: list[tuple[str, list[int], int, np.ndarray]] = []  # (rid, ids, start pos, slots)
        copies: list[tuple[str, Copy]] = []
        while waiting and mgr.can_admit(prompts[waiting[0]], ns):
            rid = waiting.pop(0)
            prompt = prompts[rid]
            adm = mgr.admit(rid, prompt, ns)
            copies += [(rid, c) for c in adm.copies]
            rows.append((rid, prompt[adm.cached_len :], adm.cached_len, adm.slot_mapping()))
            result.cached_tokens[rid] = adm.cached_len
            result.tokens[rid], result.logits[rid] = [], []
        if not rows and not running:
            raise RuntimeError(f"request {waiting[0]!r} does not fit in the cache")
        for rid in running:
            tok = result.tokens[rid][-1]
            res = mgr.append(rid, [tok])
            copies += [(rid, c) for c in res.copies]
            rows.append((rid, [tok], mgr.num_tokens(rid) - 1, res.slots))
        transfers = mgr.take_transfers()
        if mgr.host is not None:
            kv.start_transfers(transfers)  # offloads, then loads
        if store is not None:  # a block gone from the store: its requests go back in line
            dropped = [d for rid in store.load(transfers.store_loads) for d in _abort(mgr, rid)]
            if dropped:
                gone = set(dropped)
                rows = [row for row in rows if row[0] not in gone]
                copies = [(rid, c) for rid, c in copies if rid not in gone]
                waiting[:0] = [rid for rid in prompts if rid in gone]
                for rid in gone:
                    del result.tokens[rid], result.logits[rid], result.cached_tokens[rid]
                result.requeued += len(gone)
        for rid, _, start, _ in rows:
            if start < len(prompts[rid]) and not result.tokens[rid]:  # a prefill row
                result.prompt_tokens += len(prompts[rid])
                result.computed_prompt_tokens += len(prompts[rid]) - start
        if rows:
            step_copies = [c for _, c in copies]
            logits = model.step(
                **_pack(rows, mgr, device), kv=kv, backend=backend, copies=step_copies
            )
        mgr.end_step()
        if store is not None:  # computed blocks leave for the store before the next admission
            store.write_through(mgr.take_store_writes())
        running = []
        for (rid, *_), row_logits in zip(rows, logits if rows else [], strict=True):
            result.logits[rid].append(row_logits.cpu())
            result.tokens[rid].append(int(row_logits.argmax()))
            if len(result.tokens[rid]) < max_new_tokens:
                running.append(rid)
            else:
                mgr.release(rid)
        if after_step is not None:
            after_step()
    return result


def new_cache(
    cfg: ModelConfig,
    *,
    num_blocks: int,
    block_size: int = 16,
    caching: bool = True,
    stepped: bool = False,
    host_blocks: int = 0,
    device: str = "cpu",
) -> tuple[CacheManager, PagedKVCache]:
    """A manager and its fp32 paged K/V storage, sized for ``cfg``; ``host_blocks`` adds a host
    tier to both (and makes the manager stepped)."""
    mgr = CacheManager(
        num_blocks=num_blocks,
        block_size=block_size,
        enable_caching=caching,
        stepped=stepped or host_blocks > 0,
        host_blocks=host_blocks,
    )
    kv = PagedKVCache(
        cfg.num_layers,
        num_blocks,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype=torch.float32,
        device=device,
        host_blocks=host_blocks,
    )
    return mgr, kv


def generate(
    model: TinyDecoder,
    prompts: dict[str, list[int]],
    *,
    max_new_tokens: int,
    caching: bool,
    block_size: int = 16,
    num_blocks: int = 64,
    host_blocks: int = 0,
    backend: Backend = "auto",
    device: str = "cpu",
) -> RunResult:
    """Generate for ``prompts`` on a fresh cache (``run_requests``)."""
    mgr, kv = new_cache(
        model.cfg,
        num_blocks=num_blocks,
        block_size=block_size,
        caching=caching,
        host_blocks=host_blocks,
        device=device,
    )
    return run_requests(
        model,
        mgr,
        kv,
        Namespace(model="tiny-random"),
        prompts,
        max_new_tokens=max_new_tokens,
        backend=backend,
        device=device,
    )


def shared_prompt_batch(
    num_prompts: int, system_len: int, vocab: int, seed: int = 0
) -> dict[str, list[int]]:
    """Prompts = one system prompt + a short random user turn each."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_len).tolist()
    return {
        f"req-{i}": system + rng.integers(0, vocab, int(rng.integers(3, 13))).tolist()
        for i in range(num_prompts)
    }


def rotating_prompt_batch(
    num_prompts: int, num_systems: int, system_len: int, vocab: int, seed: int = 0
) -> dict[str, list[int]]:
    """Prompt ``i`` = system prompt ``i % num_systems`` + a short random user turn."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_len).tolist() for _ in range(num_systems)]
    return {
        f"req-{i}": systems[i % num_systems]
        + rng.integers(0, vocab, int(rng.integers(3, 13))).tolist()
        for i in range(num_prompts)
    }


def compare_host_tier(
    host_blocks: int = 32,
    num_blocks: int = 8,
    num_prompts: int = 9,
    max_new_tokens: int = 4,
    backend: Backend = "auto",
    device: str = "cpu",
) -> tuple[RunResult, RunResult, RunResult, float]:
    """A workload a ``num_blocks`` GPU pool cannot keep cached, run with a host tier, without
    one and without caching; returns the three runs and the max logit diff to the uncached."""
    model = TinyDecoder(ModelConfig(), device=device)
    prompts = rotating_prompt_batch(num_prompts, 3, 40, model.cfg.vocab)
    kw = {"max_new_tokens": max_new_tokens, "num_blocks": num_blocks, "backend": backend}
    tiered = generate(model, prompts, caching=True, host_blocks=host_blocks, device=device, **kw)
    gpu_only = generate(model, prompts, caching=True, device=device, **kw)
    plain = generate(model, prompts, caching=False, device=device, **kw)
    diff = max(
        float((a - b).abs().max())
        for run in (tiered, gpu_only)
        for rid in prompts
        for a, b in zip(run.logits[rid], plain.logits[rid], strict=True)
    )
    return tiered, gpu_only, plain, diff


def compare(
    num_prompts: int = 6,
    system_len: int = 40,
    max_new_tokens: int = 8,
    backend: Backend = "auto",
    device: str = "cpu",
) -> tuple[RunResult, RunResult, float]:
    """Generate with and without prefix caching; returns both runs and the max logit diff."""
    model = TinyDecoder(ModelConfig(), device=device)
    prompts = shared_prompt_batch(num_prompts, system_len, model.cfg.vocab)
    runs = [
        generate(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            caching=caching,
            backend=backend,
            device=device,
        )
        for caching in (True, False)
    ]
    diff = max(
        float((a - b).abs().max())
        for rid in prompts
        for a, b in zip(runs[0].logits[rid], runs[1].logits[rid], strict=True)
    )
    return runs[0], runs[1], diff


_REFERENCE_RUNS: dict[tuple[object, ...], tuple[RunResult, ...]] = {}


def compare_store(
    spec: str | KVBlockStore,
    num_prompts: int = 8,
    num_systems: int = 2,
    system_len: int = 64,
    max_new_tokens: int = 4,
    backend: Backend = "auto",
    device: str = "cpu",
) -> dict[str, object]:
    """Serve prompts over ``num_systems`` shared system prompts three ways in this process:
    through the shared store ``spec`` (a ``--store`` value, or a store its caller closes), with a
    fresh cache alone, and without caching. Returns the prefill tokens each computed in the
    system prompts (where the store can help), whether the tokens match the uncached run, and
    the max logit difference."""
    model = TinyDecoder(ModelConfig(), device=device)
    prompts = rotating_prompt_batch(num_prompts, num_systems, system_len, model.cfg.vocab)
    ns = Namespace(model="tiny-random")

    def system_computed(run: RunResult) -> int:
        return sum(max(0, system_len - run.cached_tokens[rid]) for rid in prompts)

    mgr, kv = new_cache(model.cfg, num_blocks=64, stepped=True, device=device)
    opened = isinstance(spec, str)  # a store given stays open: its owner closes it
    kv_store = open_store(spec, default_capacity_bytes=64 << 20) if isinstance(spec, str) else spec
    connector = KVStoreConnector(kv_store, kv, owns_backend=opened)
    try:
        mgr = CacheManager(64, mgr.block_size, stepped=True, store=connector)
        shared = run_requests(
            model,
            mgr,
            kv,
            ns,
            prompts,
            max_new_tokens=max_new_tokens,
            backend=backend,
            device=device,
            store=connector,
        )
        connector.flush()
        counters = connector.counters()
    finally:
        connector.close()
    key = (num_prompts, num_systems, system_len, max_new_tokens, backend, device)
    if key not in _REFERENCE_RUNS:  # the same in every call: computed once a process
        _REFERENCE_RUNS[key] = tuple(
            generate(
                model,
                prompts,
                max_new_tokens=max_new_tokens,
                caching=caching,
                backend=backend,
                device=device,
            )
            for caching in (True, False)
        )
    alone, plain = _REFERENCE_RUNS[key]
    diff = max(
        float((a - b).abs().max())
        for rid in prompts
        for a, b in zip(shared.logits[rid], plain.logits[rid], strict=True)
    )
    return {
        "system_tokens_computed": system_computed(shared),
        "system_tokens_computed_alone": system_computed(alone),
        "prefill_tokens_computed": shared.computed_prompt_tokens,
        "prefill_tokens_computed_alone": alone.computed_prompt_tokens,
        "prompt_tokens": shared.prompt_tokens,
        "loaded_blocks": counters.loaded_blocks,
        "written_blocks": counters.written_blocks,
        "refused": counters.refused,
        "query_errors": counters.query_errors,
        "write_errors": counters.write_errors,
        "dropped_blocks": counters.dropped_blocks,
        "requeued": shared.requeued,
        "identical": shared.tokens == plain.tokens == alone.tokens,
        "max_logit_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--interpret", action="store_true", help="Triton interpreter on CPU")
    parser.add_argument("--host-blocks", type=int, default=0, help="host tier size in blocks")
    parser.add_argument(
        "--store",
        metavar="PATH|URL",
        help="share computed blocks through a K/V store: a directory or lmdb:///PATH?capacity=SIZE "
        "(LMDB, one host; 64 MiB by default) or mooncake://MASTER:PORT?metadata=URL; run it "
        "twice to see the second process load them",
    )
    parser.add_argument("--json", action="store_true", help="with --store: print one JSON line")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels first import triton
    device = "cuda" if torch.cuda.is_available() and not args.interpret else "cpu"
    if args.store:
        try:
            out = compare_store(args.store, backend=args.backend, device=device)
        except ConfigError as exc:  # a store that cannot be opened, said without a traceback
            raise SystemExit(f"--store {args.store}: {exc}") from None
        if args.json:
            print(json.dumps(out))
        else:
            print(
                f"system-prompt tokens computed: {out['system_tokens_computed']} through the "
                f"store, {out['system_tokens_computed_alone']} with a fresh cache alone; "
                f"{out['loaded_blocks']} blocks loaded, {out['written_blocks']} written"
            )
            print(
                f"generated tokens identical: {out['identical']}; max |logit diff| = "
                f"{out['max_logit_diff']:.2e} (tol {LOGIT_TOL})"
            )
        if not out["identical"] or float(out["max_logit_diff"]) > LOGIT_TOL:  # type: ignore[arg-type]
            raise SystemExit("mismatch between the store run and the uncached run")
        return
    if args.host_blocks:
        tiered, gpu_only, plain, diff = compare_host_tier(
            args.host_blocks, backend=args.backend, device=device
        )
        same = tiered.tokens == plain.tokens == gpu_only.tokens
        print(f"device {device}, backend {args.backend}, {len(tiered.tokens)} prompts")
        print(
            f"prefill tokens computed: {tiered.computed_prompt_tokens} with a host tier of "
            f"{args.host_blocks} blocks, {gpu_only.computed_prompt_tokens} with the GPU pool "
            f"alone, {plain.computed_prompt_tokens} without caching"
        )
        print(
            f"generated tokens identical: {same}; max |logit diff| = {diff:.2e} (tol {LOGIT_TOL})"
        )
        if not same or diff > LOGIT_TOL:
            raise SystemExit("mismatch between cached and uncached runs")
        return
    cached, plain, diff = compare(backend=args.backend, device=device)
    same = cached.tokens == plain.tokens
    print(f"device {device}, backend {args.backend}, {len(cached.tokens)} prompts")
    print(
        f"prefill tokens computed: {cached.computed_prompt_tokens} with prefix caching, "
        f"{plain.computed_prompt_tokens} without (of {cached.prompt_tokens} prompt tokens)"
    )
    print(f"generated tokens identical: {same}; max |logit diff| = {diff:.2e} (tol {LOGIT_TOL})")
    if not same or diff > LOGIT_TOL:
        raise SystemExit("mismatch between cached and uncached runs")


if __name__ == "__main__":
    main()
