"""Compile every kernel variant for a GPU architecture without a GPU (``ptxas`` ships with triton).

The Triton interpreter does not enforce the compiler's rules (loop-carried types, constexpr use,
layouts), so this catches what CPU tests cannot. Run
``python -m prefixcache.kernels.compile_check`` with TRITON_INTERPRET unset: ``triton.jit`` picks
its mode at import time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def _attention_variants() -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(label, constexprs, dtype of q/k/v/out) per variant; covers every constexpr branch."""
    variants = []
    prefix = {"CAUSAL": False, "RETURN_LSE": True}  # shared-prefix pass
    suffix = {"HAS_KV_START": True, "RETURN_LSE": True}  # own-keys pass
    # dtype, head_dim, block_q, block_m, tile_n, splits, constexprs that differ from the default
    cases: list[tuple[str, int, int, int, int, int, dict[str, Any]]] = [
        ("fp16", 128, 1, 16, 64, 1, {}),
        ("bf16", 128, 1, 16, 64, 8, {}),
        ("fp32", 64, 16, 64, 64, 4, {}),
        ("bf16", 128, 16, 64, 32, 1, {}),
        ("fp16", 64, 1, 16, 64, 1, {"num_seqs": 1}),  # ints equal to 1 are specialized
        ("fp32", 128, 5, 16, 16, 1, {}),
        ("bf16", 128, 32, 128, 32, 1, prefix),  # Hopper-size tile
        ("bf16", 128, 16, 64, 32, 4, prefix),
        ("fp16", 128, 1, 16, 64, 1, suffix),
        ("bf16", 128, 1, 16, 64, 4, suffix | {"KV_FP8": True}),
        ("fp16", 64, 16, 64, 64, 1, {"KV_FP8": True}),
        ("bf16", 128, 32, 128, 64, 1, {"UNMASKED_TILES": False}),  # every tile masked
        ("fp16", 128, 1, 16, 64, 4, suffix | {"UNMASKED_TILES": False}),
    ]
    for dtype, d, block_q, block_m, tile_n, splits, extra in cases:
        const = {
            "HEAD_DIM": d,
            "BLOCK_SIZE": 16,
            "GROUP": 4 if block_q * 4 <= block_m else 3,
            "BLOCK_Q": block_q,
            "BLOCK_M": block_m,
            "TILE_N": tile_n,
            "NUM_SPLITS": splits,
            "SPLIT": splits > 1,
            "CAUSAL": True,
            "HAS_KV_START": False,
            "RETURN_LSE": False,
            "KV_FP8": False,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "UNMASKED_TILES": True,
            **extra,
        }
        variants.append(
            (
                f"attention {dtype} d{d} q{block_q} m{block_m} n{tile_n} s{splits} "
                + " ".join(
                    k.lower() if v else f"no-{k.lower()}"
                    for k, v in extra.items()
                    if isinstance(v, bool)
                ),
                const,
                {"dtype": dtype},
            )
        )
    return variants


def _signature(fn: Any, const: dict[str, Any], ptrs: dict[str, str]) -> dict[str, str]:
    """Argument types: listed pointers, fp32 scale, i32 for every other runtime scalar."""
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            floats = ("qk_scale", "v_scale", "k_scale")
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from prefixcache.kernels.triton_attention import (
        merge_prefix_kernel,
        merge_splits_kernel,
        paged_attention_kernel,
    )
    from prefixcache.kernels.triton_store import store_kv_kernel

    target = GPUTarget("cuda", args.arch, 32)
    jobs = []
    for label, const, kind in _attention_variants():
        dt = PTR[kind["dtype"]]
        kv = "*u8" if const.get("KV_FP8") else dt
        out = "*fp32" if const.get("RETURN_LSE") else dt
        ptrs = {"out_ptr": out, "q_ptr": dt, "k_cache_ptr": kv, "v_cache_ptr": kv}
        ptrs |= dict.fromkeys(("seg_out_ptr", "seg_lse_ptr", "lse_ptr"), "*fp32")
        ptrs |= dict.fromkeys(
            ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "kv_start_ptr"), "*i32"
        )
        jobs.append((label, paged_attention_kernel, const, ptrs, 4))
    for dtype, splits, block_h, lse in (("bf16", 32, 2, False), ("fp32", 4, 8, True)):
        const = {"HEAD_DIM": 128, "NUM_SPLITS": splits, "BLOCK_H": block_h, "RETURN_LSE": lse}
        ptrs = {"out_ptr": PTR[dtype], "lse_ptr": "*fp32"}
        ptrs |= {"seg_out_ptr": "*fp32", "seg_lse_ptr": "*fp32"}
        jobs.append((f"merge {dtype} s{splits} h{block_h}", merge_splits_kernel, const, ptrs, 4))
    for dtype, lse in (("bf16", False), ("fp16", True)):
        const = {"HEAD_DIM": 128, "BLOCK_H": 8, "RETURN_LSE": lse}
        names = ("lse_ptr", "suffix_out_ptr", "suffix_lse_ptr", "prefix_out_ptr", "prefix_lse_ptr")
        ptrs = {"out_ptr": PTR[dtype], "prefix_row_ptr": "*i32"} | dict.fromkeys(names, "*fp32")
        jobs.append((f"merge-prefix {dtype} lse={lse}", merge_prefix_kernel, const, ptrs, 4))
    for dtype, d, slot, fp8 in (
        ("fp16", 128, "*i64", False),
        ("bf16", 80, "*i32", False),
        ("bf16", 128, "*i64", True),
    ):
        const = {
            "HEAD_DIM": d,
            "HEAD_DIM_PAD": 1 << (d - 1).bit_length(),
            "BLOCK_SIZE": 16,
            "BLOCK_T": 32,
            "QUANT_FP8": fp8,
        }
        ptrs = dict.fromkeys(("k_ptr", "v_ptr"), PTR[dtype])
        ptrs |= dict.fromkeys(("k_cache_ptr", "v_cache_ptr"), "*u8" if fp8 else PTR[dtype])
        ptrs["slot_mapping_ptr"] = slot
        jobs.append((f"store {dtype} d{d} {slot} fp8={fp8}", store_kv_kernel, const, ptrs, 4))

    if args.arch < 89:  # e4m3 conversions need sm_89+; the wrappers refuse fp8 caches there
        jobs = [job for job in jobs if not (job[2].get("KV_FP8") or job[2].get("QUANT_FP8"))]
    for label, fn, const, ptrs, num_warps in jobs:
        src = ASTSource(fn, _signature(fn, const, ptrs), const)
        kernel = triton.compile(src, target=target, options={"num_warps": num_warps})
        print(f"ok  sm_{args.arch}  {label}  shared={kernel.metadata.shared}B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
