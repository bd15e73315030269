"""A worked example of paged attention, run through the library (docs/architecture.md).

Two sequences of 10 and 7 tokens, block size 4, sharing their first 4 tokens: the manager finds the
shared block by prefix matching, and attention read through the block tables equals attention over
the contiguous K/V.
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import dataclass
from typing import Any

from prefixcache.blocks.namespace import Namespace
from prefixcache.manager.cache_manager import CacheManager


@dataclass(frozen=True)
class DemoSetup:
    """The example's shapes: sequence lengths, the shared prefix, heads and the block pool."""

    lengths: tuple[int, ...] = (10, 7)
    shared_tokens: int = 4  # the first tokens of every sequence are the same
    block_size: int = 4
    num_blocks: int = 7
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8


SETUP = DemoSetup()


@dataclass(frozen=True)
class DemoResult:
    setup: DemoSetup
    physical_cache_shape: tuple[int, ...]  # one layer's K cache: blocks, slots, heads, head dim
    dtype: str
    block_tables: list[list[int]]
    max_attention_abs_diff: float
    unique_blocks: int
    allocated_slots: int
    unique_live_tokens: int
    internal_fragmentation_slots: int
    prefix_sharing_saved_slots: int


def run_demo(device: str = "cpu", seed: int = 53, setup: DemoSetup = SETUP) -> DemoResult:
    import torch

    from prefixcache.kernels.reference import reference_attention
    from prefixcache.kv_cache import PagedKVCache

    torch.manual_seed(seed)
    lengths, shared = setup.lengths, setup.shared_tokens
    hq, hkv, d, p = setup.q_heads, setup.kv_heads, setup.head_dim, setup.block_size
    dtype = torch.float32
    # token ids: the first ``shared`` are the same in every sequence, the rest differ
    prompts = [list(range(100, 100 + n)) for n in lengths]
    for i in range(1, len(prompts)):
        prompts[i][shared:] = [100 * (10 - i) + k for k in range(lengths[i] - shared)]
    prefix = torch.randn(shared, hkv, d, device=device, dtype=dtype)
    ks = [
        torch.cat((prefix, torch.randn(n - shared, hkv, d, device=device, dtype=dtype)))
        for n in lengths
    ]
    vs = [
        torch.cat((prefix * 0.5, torch.randn(n - shared, hkv, d, device=device, dtype=dtype)))
        for n in lengths
    ]

    mgr = CacheManager(num_blocks=setup.num_blocks, block_size=p)
    kv = PagedKVCache(1, setup.num_blocks, p, hkv, d, dtype=dtype, device=device)
    ns = Namespace(model="seed-example")
    tables = []
    for i, tokens in enumerate(prompts):
        adm = mgr.admit(f"seq{i}", tokens, ns)
        # write only what the cache did not already hold, then run the copies
        kv.write(0, ks[i][adm.cached_len :], vs[i][adm.cached_len :], adm.slot_mapping())
        kv.apply_copies(adm.copies, 0)
        tables.append(adm.block_table)

    q = torch.randn(len(lengths), 1, hq, d, device=device, dtype=dtype)
    max_diff = 0.0
    for i, n in enumerate(lengths):
        pk, pv = kv.gather(0, tables[i], n)
        torch.testing.assert_close(pk, ks[i])
        torch.testing.assert_close(pv, vs[i])
        dense = reference_attention(q[i], ks[i], vs[i])
        paged = reference_attention(q[i], pk, pv)
        max_diff = max(max_diff, (paged - dense).abs().max().item())

    unique = len({b for t in tables for b in t})
    live = sum(lengths) - shared * (len(lengths) - 1)  # shared tokens count once
    allocated = unique * p
    unshared = sum(-(-n // p) for n in lengths) * p
    mgr.check_integrity()
    for i in range(len(lengths)):
        mgr.release(f"seq{i}")
    mgr.check_integrity()
    return DemoResult(
        setup,
        tuple(kv.k[0].shape),
        str(dtype),
        tables,
        max_diff,
        unique,
        allocated,
        live,
        allocated - live,
        unshared - allocated,
    )


def format_demo(result: DemoResult, device: str = "cpu") -> str:
    import torch

    r, s = result, result.setup
    return "\n".join(
        [
            f"python={platform.python_version()} torch={torch.__version__}",
            f"device={device} dtype={r.dtype} Hq={s.q_heads} Hkv={s.kv_heads} D={s.head_dim} "
            f"block_size={s.block_size}",
            f"lengths={s.lengths} block_tables={r.block_tables}",
            f"physical_cache={r.physical_cache_shape} shared_physical_block={r.block_tables[0][0]}",
            f"max_attention_abs_diff={r.max_attention_abs_diff:.3e}",
            f"unique_blocks={r.unique_blocks} allocated_slots={r.allocated_slots} "
            f"unique_live_tokens={r.unique_live_tokens}",
            f"internal_fragmentation_slots={r.internal_fragmentation_slots} "
            f"prefix_sharing_saved_slots={r.prefix_sharing_saved_slots}",
        ]
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.inference_mode():
        print(format_demo(run_demo(device), device))
    return 0


def register(sub: Any) -> None:
    lengths = " and ".join(map(str, SETUP.lengths))
    s = SETUP
    parser = sub.add_parser(
        "demo",
        help=f"run the paged-attention worked example ({lengths} tokens)",
        description=f"Run a worked example of paged attention through the library: sequences "
        f"of {lengths} tokens sharing their first {s.shared_tokens}, in blocks of "
        f"{s.block_size} tokens. The cache manager finds the shared block by prefix matching; "
        "the command prints the block tables, the blocks and slots saved by sharing, and how "
        "far attention read through the block tables is from attention over contiguous K/V "
        "(it should be about 0). Runs on CPU in seconds; --device picks another torch device.",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    parser.set_defaults(func=_cmd_demo)
