"""vLLM's own scheduler and connector roles, built without a GPU or a model run, for the store
connector's tests (these run in vLLM's virtualenv: see ``test_connector_in_vllm.py`` one folder
up).

``Engine`` is one vLLM engine in miniature: vLLM's ``Scheduler`` with the connector on its
scheduler side, the connector's worker role over real CPU-attention-shaped K/V tensors, and a
stand-in forward pass that writes each computed token's K/V as a function of its position, its
token and the tokens before it, so a block loaded from the store must equal, byte for byte, the
block a cold engine computes.
"""

from __future__ import annotations

import os
from itertools import count
from pathlib import Path
from typing import Any

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
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from prefixcache.engines.vllm.connector import PrefixcacheStoreConnector

MODEL = Path(os.environ.get("PREFIXCACHE_VLLM_MODEL", "~/.cache/prefixcache/models/tiny-llama"))
EOS = 2
HEADS, HEAD_SIZE, LAYERS = 2, 64, 2
_ids = count(1)
init_none_hash(sha256)


def make_config(
    store: str,
    *,
    block_size: int = 32,
    max_batched: int = 4096,
    policy: str = "recompute",
    **extra: Any,
) -> VllmConfig:
    """A ``VllmConfig`` for the tiny model with the store connector on ``store``."""
    model = ModelConfig(
        model=str(MODEL.expanduser()),
        dtype="float32",
        seed=0,
        max_model_len=4096,
        served_model_name="tiny-llama",
    )
    transfer = KVTransferConfig(
        kv_connector="PrefixcacheStoreConnector",
        kv_connector_module_path="prefixcache.engines.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
        kv_connector_extra_config={"store": store, **extra},
    )
    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_batched,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def cache_config(block_size: int, num_blocks: int) -> KVCacheConfig:
    """One full-attention group over the tiny model's two layers."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def make_request(
    tokens: list[int],
    *,
    max_tokens: int = 2,
    block_size: int = 32,
    cache_salt: str | None = None,
    lora: str | None = None,
) -> Request:
    """A vLLM request for ``tokens``, its block hashes computed as the engine's are."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        lora_request=None if lora is None else LoRARequest(lora, 1, f"/adapters/{lora}"),
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def kv_value(tokens: list[int], pos: int, layer: int, part: int) -> float:
    """The stand-in K (part 0) or V (part 1) of the token at ``pos``: its position, its token,
    a digest of the tokens before it, its layer."""
    prefix = sum((t + 1) * (i + 1) for i, t in enumerate(tokens[:pos])) % 9973
    return float(tokens[pos] * 3 + pos * 0.25 + prefix * 0.001 + layer * 1000 + part * 500)


class EventRecorder:
    """Stands in for vLLM's KV event publisher: keeps every published event."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return

    def take(self, kind: str) -> list[Any]:
        """The events of class ``kind`` published so far, taken out."""
        found = [e for e in self.events if type(e).__name__ == kind]
        self.events = [e for e in self.events if type(e).__name__ != kind]
        return found


class Engine:
    """vLLM's scheduler and the connector's two roles, driven step by step."""

    def __init__(self, config: VllmConfig, num_blocks: int = 256) -> None:
        self.config = config
        self.block_size = config.cache_config.block_size
        kv_config = cache_config(self.block_size, num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=self.block_size,
        )
        self.connector = self.scheduler.connector
        self.published = EventRecorder()
        self.scheduler.kv_event_publisher = self.published
        assert isinstance(self.connector, PrefixcacheStoreConnector)
        self.worker = PrefixcacheStoreConnector(config, KVConnectorRole.WORKER, kv_config)
        shape = (num_blocks, HEADS, self.block_size, 2 * HEAD_SIZE)
        self.kv = {
            name: torch.full(shape, -1.0, dtype=torch.float32)
            for name in kv_config.kv_cache_groups[0].layer_names
        }
        self.worker.register_kv_caches(self.kv)
        self.requests: dict[str, Request] = {}
        self.loaded_tokens: dict[str, int] = {}  # external tokens vLLM took per request
        self.load_errors: set[int] = set()
        self.block_ids: dict[str, list[int]] = {}  # each request's blocks, as last scheduled
        self.forward_tokens = 0  # tokens the stand-in forward computed

    def add(self, request: Request) -> Request:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self, fail_loads: bool = False) -> Any:
        """One engine step: schedule, load, forward, save, report back; returns the output."""
        out = self.scheduler.schedule()
        plan = out.kv_connector_metadata
        for new in out.scheduled_new_reqs:
            self.loaded_tokens.setdefault(new.req_id, new.num_computed_tokens)
        for req_id in out.num_scheduled_tokens:
            manager = self.scheduler.kv_cache_manager
            self.block_ids[req_id] = list(manager.get_block_ids(req_id)[0])
        self.worker.bind_connector_metadata(plan)
        self.worker.start_load_kv(None)
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens - n
            self._forward(request, start, n)
            sampled[req_id] = [7] if start + n >= request.num_tokens else []
        self.worker.wait_for_save()
        report = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        ids = list(sampled)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            kv_connector_output=KVConnectorOutput(
                invalid_block_ids=errors, kv_connector_worker_meta=report
            ),
        )
        self.scheduler.update_from_output(out, runner)
        return out

    def _forward(self, request: Request, start: int, n: int) -> None:
        """Write the K/V of tokens ``start .. start+n`` at their slots."""
        tokens = request.all_token_ids
        blocks = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        bs = self.block_size
        for pos in range(start, start + n):
            block, offset = blocks[pos // bs], pos % bs
            for layer, cache in enumerate(self.kv.values()):
                view = cache.view(cache.shape[0], HEADS, 2, bs, HEAD_SIZE)
                view[block, :, 0, offset, :] = kv_value(tokens, pos, layer, 0)
                view[block, :, 1, offset, :] = kv_value(tokens, pos, layer, 1)
        self.forward_tokens += n

    def run(self, limit: int = 200) -> None:
        """Step until every request finished and the writes are settled."""
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
            self.worker.flush_writes()  # the tests read the store right after
        raise AssertionError("the engine did not drain")

    def block_kv(self, request: Request, block_index: int) -> torch.Tensor:
        """Every layer's K/V of one block of ``request`` (a copy; its blocks as last
        scheduled, whose contents stay until vLLM hands them out again)."""
        blocks = self.block_ids[request.request_id]
        return torch.stack([c[blocks[block_index]].clone() for c in self.kv.values()])

    def expected_kv(self, request: Request, block_index: int) -> torch.Tensor:
        """What the stand-in forward writes for that block."""
        bs, tokens = self.block_size, request.all_token_ids
        out = torch.empty(LAYERS, HEADS, 2, bs, HEAD_SIZE)
        for layer in range(LAYERS):
            for offset in range(bs):
                pos = block_index * bs + offset
                out[layer, :, 0, offset, :] = kv_value(tokens, pos, layer, 0)
                out[layer, :, 1, offset, :] = kv_value(tokens, pos, layer, 1)
        return out.view(LAYERS, HEADS, bs, 2 * HEAD_SIZE)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
