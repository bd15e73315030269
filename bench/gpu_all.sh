#!/usr/bin/env bash
# Every GPU check of the kernels in one command, on a CUDA machine, from the repository root, with
# the checkout installed (e.g. `PREFIXCACHE_COMPILE=0 pip install --no-deps -e .`):
#
#     bash bench/gpu_all.sh OUTDIR [PARTS]
#
# 1. In parallel (nothing here is timed): the kernel tests compiled on the GPU
#    (TRITON_INTERPRET=0, pytest-xdist when installed), the batched block transfers' tests on
#    CUDA (host tier and store rows against block-by-block copies), examples/tiny_runtime.py with
#    and without a host tier, and bench/kernel_gpu.py --warm in a few processes, which compiles
#    every kernel variant the timed run launches into Triton's cache.
# 2. One at a time, so that nothing else shares the GPU: the host tier's pinned copy bandwidths
#    (bench/host_tier.py --copies-only), the batched transfers against block-by-block copies and
#    the pinned-copy bandwidth (bench/transfer_bandwidth.py), bench/kernel_gpu.py (PARTS, default
#    all) and `prefixcache calibrate --gpu h200`.
#
# Each step has a time limit and its exit status is printed; logs, the benchmark's JSON lines and
# the calibrated profile go to OUTDIR. Exits non-zero if any step failed.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_all.sh OUTDIR [PARTS]}
parts=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, report status and duration
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    return "$rc"
}

echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
python3 -c "import sys, torch, triton; p = torch.cuda.get_device_properties(0); print(
    f'python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), '
    f'triton {triton.__version__}, {p.name}, {p.multi_processor_count} SMs')"

xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 8)
warm_groups=(decode,fp8,store shared,graphs extend splits decode-configs fp8-configs,store-configs)

step tests 240 python3 -m pytest tests/kernels -q -p no:cacheprovider "${xdist[@]}" \
    >"$out/tests.log" 2>&1 &
tests=$!
step transfer-tests 240 python3 -m pytest tests/core/test_kv_transfer.py \
    tests/store/test_store_block_copies.py -q -p no:cacheprovider >"$out/transfer-tests.log" 2>&1 &
transfer_tests=$!
{
    step tiny-runtime 120 python3 examples/tiny_runtime.py
    step tiny-runtime-host-tier 120 python3 examples/tiny_runtime.py --host-blocks 32
} >"$out/runtime.log" 2>&1 &
runtime=$!
for group in "${warm_groups[@]}"; do
    step "warm $group" 300 python3 bench/kernel_gpu.py --skip-tests --warm --parts "$group" &
done >"$out/warm.log" 2>&1
wait "$tests" || failed=1
wait "$runtime" || failed=1
wait "$transfer_tests" || failed=1
wait  # the warm-up processes
tail -n 3 "$out/tests.log"
tail -n 3 "$out/transfer-tests.log"
grep -E '^(== |device|prefill|generated)' "$out/runtime.log"
grep -E '^== warm' "$out/warm.log"

step host-tier-copies 120 python3 bench/host_tier.py --copies-only --repeats 5 || failed=1
step transfer-bandwidth 300 python3 bench/transfer_bandwidth.py --repeats 5 \
    --json "$out/transfers.jsonl" || failed=1
step kernel-bench 420 python3 bench/kernel_gpu.py --skip-tests ${parts:+--parts "$parts"} \
    --json "$out/kernel.jsonl" || failed=1
step calibrate 240 python3 -m prefixcache calibrate --gpu h200 \
    --out "$out/gpu-profile-h200.json" || failed=1
exit "$failed"
