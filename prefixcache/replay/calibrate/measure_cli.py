"""``prefixcache calibrate``: measure this GPU and write a profile for ``replay --gpu-profile``."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.replay.calibrate.profile_fit import DEFAULT_STEP_OVERHEAD_S
from prefixcache.replay.model_specs import GpuConfig, ModelConfig, get_gpu, get_model, model_names


def register(subparsers: Any) -> None:
    cp = subparsers.add_parser(
        "calibrate",
        help="time a random-weight model on this GPU and write a GPU profile for the replay",
        description="Build a random-weight model of --model's shape (no download), time fresh "
        "prefill (torch SDPA), extend over a paged cache and decode batches (this project's "
        "paged kernel), a dense matmul and a device copy, fit the serving roofline's "
        "efficiencies to the step times and write them as a GPU profile JSON, which "
        "'prefixcache replay --mode serving --gpu-profile FILE' reads. Needs a CUDA GPU; "
        "'--device cpu --tiny' runs the same steps on a tiny model on CPU, as a check.",
    )
    cp.add_argument(
        "--model",
        default="llama-3.1-8b",
        help=f"model shape to build: {', '.join(model_names())}, or a model file with "
        "hidden_size, intermediate_size and vocab_size (llama-3.1-8b)",
    )
    cp.add_argument(
        "--gpu",
        help="a table GPU whose datasheet peak FLOP/s and bandwidth the efficiencies are "
        "fractions of (default: the measured matmul peak and copy bandwidth)",
    )
    cp.add_argument("--name", help="the profile's GPU name (default: the device's name)")
    cp.add_argument("--out", type=Path, help="profile file (default gpu-profile-NAME.json)")
    cp.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(cuda)")
    cp.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer model and small shapes instead of --model's (with --device cpu: a "
        "check of the command, not a calibration)",
    )
    cp.add_argument(
        "--step-overhead",
        type=float,
        metavar="SECONDS",
        help="fixed per-step overhead the fit assumes "
        f"({DEFAULT_STEP_OVERHEAD_S:g}; 0 with --tiny)",
    )
    cp.add_argument("--warmup", type=int, default=3, help="untimed runs per shape (3)")
    cp.add_argument("--repeats", type=int, default=10, help="timed runs per shape; median (10)")
    cp.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from prefixcache.replay.calibrate.decoder_timing import (
        FULL_SHAPES,
        TINY_MODEL,
        TINY_SHAPES,
        run_bench,
    )
    from prefixcache.replay.calibrate.gpu_profile import write_profile
    from prefixcache.replay.calibrate.profile_fit import fit_profile

    if args.warmup < 0 or args.repeats < 1:
        raise ConfigError("--warmup must be >= 0 and --repeats >= 1")
    if args.step_overhead is not None and not args.step_overhead >= 0:
        raise ConfigError(f"--step-overhead must be >= 0, got {args.step_overhead}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "no CUDA GPU found; calibrate times a real GPU (on CPU only --device cpu --tiny "
            "runs, as a check of the command)"
        )
    if args.device == "cpu" and not args.tiny:
        raise ConfigError("--device cpu runs only with --tiny (a CPU is no GPU to calibrate)")
    model = TINY_MODEL if args.tiny else _buildable(get_model(args.model))
    shapes = TINY_SHAPES if args.tiny else FULL_SHAPES
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overhead = args.step_overhead
    if overhead is None:
        overhead = 0.0 if args.tiny else DEFAULT_STEP_OVERHEAD_S
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"timing {model.name} ({dtype}) on {device_name}", file=sys.stderr)
    bench = run_bench(model, shapes, device, dtype, warmup=args.warmup, repeats=args.repeats)
    reference = _reference(args, device, device_name, bench.matmul_flops, bench.copy_bytes_per_s)
    calibration = {
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "measured_matmul_flops": float(f"{bench.matmul_flops:.4g}"),
        "measured_copy_bytes_per_s": float(f"{bench.copy_bytes_per_s:.4g}"),
        "reference": "datasheet" if args.gpu else "measured",
    }
    profile = fit_profile(
        bench.measurements,
        model,
        reference,
        step_overhead_s=overhead,
        calibration=calibration,
        reference_is_lower_bound=args.gpu is None,
    )
    out = args.out or Path(f"gpu-profile-{profile.name}.json")
    write_profile(profile, out)
    for row in profile.calibration["measurements"]:
        shape = f"{row['kind']} {row['batch']}x{row['new_tokens']}"
        if row["context"]:
            shape += f" after {row['context']}"
        print(
            f"  {shape:<26} measured {row['seconds'] * 1e3:9.3f} ms  "
            f"roofline {row['predicted_s'] * 1e3:9.3f} ms  ({row['ratio']:.2f}x)"
        )
    print(
        f"  MFU {profile.compute_efficiency:.1%}, bandwidth eff. {profile.memory_efficiency:.1%}"
        f", step overhead {profile.step_overhead_s * 1e3:g} ms"
    )
    print(f"wrote {out}")
    return 0


def _buildable(model: ModelConfig) -> ModelConfig:
    """``model`` when calibrate can build it: a dense model with every shape known."""
    if model.active_params is not None:
        raise ConfigError(f"{model.name} is a mixture of experts; calibrate builds dense models")
    missing = [
        f for f in ("hidden_size", "intermediate_size", "vocab_size") if getattr(model, f) is None
    ]
    if missing:
        raise ConfigError(f"model {model.name} lacks {', '.join(missing)}, needed to build it")
    return model


def _reference(
    args: argparse.Namespace, device: Any, device_name: str, flops: float, bandwidth: float
) -> GpuConfig:
    """What the efficiencies are fractions of: a table GPU's datasheet, or what was measured."""
    import torch

    name = args.name or (args.gpu or device_name).lower().replace(" ", "-")
    if args.gpu:
        table = get_gpu(args.gpu)
        return GpuConfig(name, table.peak_flops, table.hbm_bytes_per_s, table.memory_bytes)
    memory = (
        int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cuda"
        else None
    )
    return GpuConfig(name, flops, bandwidth, memory)
