"""The vLLM store connector's get and put per block, against a memcpy of the same bytes.

    python bench/vllm_store_blocks.py [--blocks 64] [--repeats 7]

Runs the connector's own worker side (``StoreWorker``) over CPU-attention-shaped K/V tensors and
a one-host LMDB store on /dev/shm, for three block sizes: the tiny test model's (32 tokens, 2
layers, 2 KV heads of 64, fp32: 64 KiB), and 1 MiB and 4 MiB blocks (32 tokens, 8 and 32
layers, 8 KV heads of 128, fp16, as an 8B-class model). Per block, median over ``--repeats``
passes of ``--blocks`` blocks:

- ``memcpy``: numpy copy of each of the pass's records' bytes, one block at a time, from one
  array into another (both touched beforehand), as many distinct bytes as the store moves;
- ``get``: ``StoreWorker.load`` (``get_into`` a staging buffer, the record's header and
  checksum checked, every layer's K and V scattered into vLLM's paged tensors);
- ``put, step``: what the step waits for in ``StoreWorker.save``: every layer's K and V
  gathered out of the paged tensors into record buffers, queued;
- ``put, all``: the same plus the background writer's checksum, header and ``put_many``, until
  the queue is drained.

Then the connector's cost per engine step when it has nothing to load or write: vLLM's own
scheduler (the tiny model's config) steps one request through 128 decode steps, once with the
connector (its scheduler side, and its worker side's hooks as vLLM's model runner calls them)
and once without, no model run in either: the difference is what the connector adds to a step.

vLLM's modules are needed (the worker's plan types subclass vLLM's), so the script runs itself
again with vLLM's interpreter (``make vllm-env``) when started from another environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
SHAPES = {  # name: (layers, kv heads, head_dim, dtype)
    "tiny fp32": (2, 2, 64, "float32"),
    "8 layers fp16": (8, 8, 128, "float16"),
    "32 layers fp16": (32, 8, 128, "float16"),
}
BLOCK = 32


def rerun_in_vllm() -> int:
    """Start this script with vLLM's interpreter, this checkout's package on its path."""
    from prefixcache.engines.vllm.install import engine_environment, find_vllm

    install = find_vllm()
    with tempfile.TemporaryDirectory(prefix="vllm-store-bench-") as folder:
        (Path(folder) / "prefixcache").symlink_to(
            Path(__file__).resolve().parents[1] / "prefixcache"
        )
        env = engine_environment(install.env, PYTHONPATH=folder)
        return subprocess.call([str(install.python), __file__, *sys.argv[1:]], env=env)


def one_pass(worker, plan_type, moves, blocks: int, layout) -> dict[str, float]:
    import numpy as np

    from prefixcache.engines.vllm.connector_plan import RequestBlocks

    t: dict[str, float] = {}
    plan = plan_type(saves=[RequestBlocks("r", moves)])
    worker.load(plan_type())  # a step without loads: nothing failed
    start = time.perf_counter()
    worker.save(plan)
    t["put, step"] = (time.perf_counter() - start) / blocks
    worker.writer.flush()
    t["put, all"] = (time.perf_counter() - start) / blocks
    start = time.perf_counter()
    worker.load(plan_type(loads=[RequestBlocks("r", moves)]))
    t["get"] = (time.perf_counter() - start) / blocks
    assert worker.take_load_errors() == set()
    src = np.ones((blocks, layout.record_bytes), np.uint8)
    out = np.zeros_like(src)
    out[:] = 2  # touched: no page faults in the timed copies
    start = time.perf_counter()
    for i in range(blocks):
        np.copyto(out[i], src[i])
    t["memcpy"] = (time.perf_counter() - start) / blocks
    return t


def run(args: argparse.Namespace) -> None:
    import torch

    from prefixcache.blocks.namespace import Namespace
    from prefixcache.engines.store_tally import StoreTally
    from prefixcache.engines.vllm.connector_layout import PagedKV
    from prefixcache.engines.vllm.connector_plan import BlockMove, StoreStepPlan
    from prefixcache.engines.vllm.connector_worker import StoreWorker
    from prefixcache.store.block_record import namespace_fingerprint
    from prefixcache.store.lmdb import LMDBBlockStore

    torch.set_num_threads(1)
    fp = namespace_fingerprint(Namespace(model="bench"))
    print(f"{args.blocks} blocks a pass, {args.repeats} passes, median per block")
    print(
        f"{'block':>16} {'MiB':>5} {'memcpy us':>10} {'get us':>8} {'get/memcpy':>11} "
        f"{'put step us':>12} {'put all us':>11} {'put all/memcpy':>15}"
    )
    for name, (layers, heads, dim, dtype) in SHAPES.items():
        num_blocks = 2 * args.blocks + 1
        kv = {
            f"layer{i}": torch.randn(num_blocks, heads, BLOCK, 2 * dim).to(getattr(torch, dtype))
            for i in range(layers)
        }
        record = 2 * layers * BLOCK * heads * dim * kv["layer0"].element_size() + 4096
        folder = tempfile.mkdtemp(dir="/dev/shm", prefix="vllm-store-bench-")
        store = LMDBBlockStore(folder, capacity_bytes=max(4 << 20, 2 * args.blocks * record))
        worker = StoreWorker(store, StoreTally(), retry_after=2.0, queue_blocks=4 * args.blocks)
        worker.register(PagedKV(kv, BLOCK, heads, dim))
        passes = []
        for repeat in range(args.repeats + 1):
            moves = [
                BlockMove(1 + i, os.urandom(16), fp, None, i) for i in range(args.blocks)
            ]  # fresh keys each pass
            t = one_pass(worker, StoreStepPlan, moves, args.blocks, worker.kv.layout)
            for move in moves:  # the next pass writes into the pages these free
                store.remove(move.digest)
            if repeat:  # the first pass touches the store's pages for the first time
                passes.append(t)
        worker.close()
        store.close()
        med = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
        ratio = {k: statistics.median(p[k] / p["memcpy"] for p in passes) for k in passes[0]}
        size = worker.kv.layout.record_bytes / MIB
        print(
            f"{name:>16} {size:5.2f} {med['memcpy'] * 1e6:10.1f} {med['get'] * 1e6:8.1f} "
            f"{ratio['get']:11.2f} {med['put, step'] * 1e6:12.1f} {med['put, all'] * 1e6:11.1f} "
            f"{ratio['put, all']:15.2f}"
        )
        shutil.rmtree(folder, ignore_errors=True)


def hook_cost(repeats: int) -> None:
    """Median time of a decode step of vLLM's scheduler with the connector and without."""
    import torch
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from prefixcache.engines.vllm.connector import PrefixcacheStoreConnector
    from prefixcache.engines.vllm.connector_settings import parse_settings
    from prefixcache.engines.vllm.install import find_vllm

    init_none_hash(sha256)
    folder = tempfile.mkdtemp(dir="/dev/shm", prefix="vllm-store-bench-")
    extra = parse_settings({"store": f"lmdb://{folder}?capacity=64MiB"})._asdict()
    extra = {k: v for k, v in extra.items() if k in ("store",)}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

    def scheduler(with_connector: bool):
        transfer = None
        if with_connector:
            transfer = KVTransferConfig(
                kv_connector="PrefixcacheStoreConnector",
                kv_connector_module_path="prefixcache.engines.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            )
        config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=4096,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            model_config=ModelConfig(model=str(find_vllm().model), dtype="float32", seed=0),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = 256
        kv_config = KVCacheConfig(256, [], [KVCacheGroupSpec(layers, spec)])
        made = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        worker = None
        if with_connector:
            worker = PrefixcacheStoreConnector(config, KVConnectorRole.WORKER, kv_config)
            worker.register_kv_caches({n: torch.zeros(256, 2, BLOCK, 128) for n in layers})
        return made, worker

    def steps(made, worker, n: int = 128) -> list[float]:
        params = SamplingParams(max_tokens=n + 1, temperature=0.0)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=os.urandom(4).hex(),
            prompt_token_ids=[3 + (i * 7919) % 31000 for i in range(64)],
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        made.add_request(request)
        out_times = []
        for _ in range(n):
            start = time.perf_counter()
            out = made.schedule()
            kv_output = None
            if worker is not None:  # as vLLM's model runner calls the worker side each step
                worker.bind_connector_metadata(out.kv_connector_metadata)
                worker.start_load_kv(None)
                worker.wait_for_save()
                errors = worker.get_block_ids_with_load_errors()
                report = worker.build_connector_worker_meta()
                worker.get_kv_connector_stats()
                worker.clear_connector_metadata()
                kv_output = KVConnectorOutput(
                    invalid_block_ids=errors, kv_connector_worker_meta=report
                )
            ids = list(out.num_scheduled_tokens)
            made.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[7] for _ in ids],
                    kv_connector_output=kv_output,
                ),
            )
            out_times.append(time.perf_counter() - start)
        return out_times[8:]  # the first steps prefill and warm up

    with_parts, without_parts = scheduler(True), scheduler(False)
    with_t, without_t = [], []
    for _ in range(repeats):  # interleaved
        with_t += steps(*with_parts)
        without_t += steps(*without_parts)
    with_parts[1].shutdown()
    with_parts[0].connector.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    a, b = statistics.median(with_t) * 1e6, statistics.median(without_t) * 1e6
    print(
        f"decode step, no model: {a:.1f} us with the connector, {b:.1f} us without: "
        f"{a - b:.1f} us a step"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return rerun_in_vllm()
    run(args)
    hook_cost(args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
