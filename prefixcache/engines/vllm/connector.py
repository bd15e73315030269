"""vLLM loads and saves prefixes through prefixcache's store: the KV connector vLLM builds by
module path.

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{
      "kv_connector": "PrefixcacheStoreConnector",
      "kv_connector_module_path": "prefixcache.engines.vllm.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "lmdb:///dev/shm/prefixcache-kv?capacity=4GiB"}}'

vLLM builds the class once in its scheduler process (``KVConnectorRole.SCHEDULER``) and once in
each worker (``WORKER``); each instance delegates to its side: connector_scheduler.py decides
what to load and to write, connector_worker.py moves and checks the bytes, connector_writer.py
writes off the step's path, connector_stats.py counts. Settings: connector_settings.py; keys:
connector_keys.py; vLLM's cache layout: connector_layout.py.

Loads are synchronous (before the forward pass of the step that needs them), so a block that
fails its check is reported in the same step and vLLM computes it; this needs
``"kv_load_failure_policy": "recompute"``, which the connector insists on. Supported: one
attention group of full attention (no hybrid, sliding-window-only or MLA model), one worker
(no tensor or pipeline parallelism), vLLM's CPU attention layout; anything else is refused at
start with the reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from prefixcache.engines.store_access import acquire_store, release_store
from prefixcache.engines.store_tally import StoreTally
from prefixcache.engines.vllm.connector_layout import PagedKV
from prefixcache.engines.vllm.connector_plan import StoreStepPlan, StoreWorkerReport
from prefixcache.engines.vllm.connector_scheduler import StoreScheduler
from prefixcache.engines.vllm.connector_settings import StoreSettings, parse_settings
from prefixcache.engines.vllm.connector_stats import StoreConnectorStats, StorePromMetrics
from prefixcache.engines.vllm.connector_tally import LOGGER
from prefixcache.engines.vllm.connector_worker import StoreWorker
from prefixcache.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(LOGGER)


class PrefixcacheStoreConnector(KVConnectorBase_V1):
    """A vLLM KV connector over a prefixcache ``KVBlockStore`` (LMDB on one host, Mooncake
    Store across hosts), keyed by prefixcache's block digests."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings: StoreSettings = parse_settings(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                'the prefixcache store connector needs "kv_load_failure_policy": '
                '"recompute" in --kv-transfer-config (a block it cannot load is then computed '
                f"by vLLM); got {transfer.kv_load_failure_policy!r}"
            )
        parallel = vllm_config.parallel_config
        if parallel.world_size != 1:
            raise ConfigError(
                "the prefixcache store connector serves one worker (no tensor or pipeline "
                f"parallelism); this engine has {parallel.world_size}"
            )
        self.block_size = int(vllm_config.cache_config.block_size)
        self._spec = _attention_spec(kv_cache_config, self.block_size)
        model = self.settings.model or _served_name(vllm_config)
        weights = self.settings.weights or getattr(vllm_config.model_config, "revision", None)
        self.tally = StoreTally()
        self._store_url: str | None = self.settings.store
        store = acquire_store(self.settings.store)
        self._scheduler: StoreScheduler | None = None
        self._worker: StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = StoreScheduler(
                store,
                self.tally,
                block_size=self.block_size,
                model=model,
                weights=weights,
                extra=self.settings.extra,
                hash_algo=self.settings.hash_algo,
                retry_after=self.settings.retry_after,
            )
        else:
            self._worker = StoreWorker(
                store,
                self.tally,
                self.settings.retry_after,
                self.settings.queue_blocks,
                self.settings.queue_bytes,
            )
        log.info(
            "prefixcache store connector (%s): store %s, model %r, weights %r, blocks of %d tokens",
            "scheduler" if self._scheduler is not None else "worker",
            self._store_url,
            model,
            weights,
            self.block_size,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped write is a later miss, nothing more."""
        return False

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` the store holds, loaded synchronously."""
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the loads into the blocks vLLM allocated."""
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's loads and writes, for the worker."""
        assert self._scheduler is not None
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM binds its KV cache manager before scheduling"
        return self._scheduler.build_plan(
            scheduler_output, lambda req_id: manager.get_block_ids(req_id)[0]
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Read the workers' report: announcements to make, writes settled."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, StoreWorkerReport) and self._scheduler is not None:
            self._scheduler.worker_report(report)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        """Nothing holds the request's blocks: its writes were copied out in their step."""
        if self._scheduler is not None:
            self._scheduler.finished(request)
        return False, None

    def take_events(self) -> list[Any]:
        """``BlockStored`` / ``BlockRemoved`` of medium ``STORE`` since the last call."""
        return [] if self._scheduler is None else self._scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        """Writes not settled yet keep vLLM stepping, so they are announced."""
        return self._scheduler is not None and self._scheduler.has_pending_writes()

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's cache tensors; a layout this connector cannot read is refused."""
        assert self._worker is not None
        num_kv_heads, head_size = self._spec
        self._worker.register(PagedKV(kv_caches, self.block_size, num_kv_heads, head_size))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load the step's blocks, checked, before the forward pass."""
        plan = self._plan()
        if plan is not None and self._worker is not None:
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete when ``start_load_kv`` returns."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        """Blocks are copied out once the step's layers are all written (``wait_for_save``)."""
        return

    def wait_for_save(self) -> None:
        """Copy the step's computed blocks out and queue them for the writer."""
        plan = self._plan()
        if plan is not None and self._worker is not None:
            self._worker.save(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks this step was to load and did not: vLLM computes them."""
        return set() if self._worker is None else self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> StoreWorkerReport | None:
        """What the store took, evicted and refused, for the scheduler's announcements."""
        return None if self._worker is None else self._worker.report()

    def flush_writes(self) -> None:
        """Wait until every block queued for writing is written, dropped or failed."""
        if self._worker is not None and self._worker.writer is not None:
            self._worker.writer.flush()

    def _plan(self) -> StoreStepPlan | None:
        if not self.has_connector_metadata():
            return None
        plan = self._get_connector_metadata()
        return plan if isinstance(plan, StoreStepPlan) else None

    # ---- both sides -----------------------------------------------------------------------
    def get_kv_connector_stats(self) -> StoreConnectorStats | None:
        """The counts since the last call (None: none moved)."""
        delta = self.tally.take_delta()
        return StoreConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> StoreConnectorStats:
        """Stats from their serialized counts."""
        return StoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> StorePromMetrics:
        """Prometheus counters ``vllm:prefixcache_store_*_total``."""
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Write what is queued, log the totals, let go of the store."""
        if self._worker is not None:
            self._worker.close()
        totals = self.tally.totals()
        if totals:
            log.info(
                "prefixcache store connector totals: %s",
                ", ".join(f"{k}={v}" for k, v in sorted(totals.items())),
            )
        if self._store_url is not None:
            release_store(self._store_url)
            self._store_url = None


def _served_name(vllm_config: Any) -> str:
    """The name clients (and the fleet service) give the model."""
    model_config = vllm_config.model_config
    name = getattr(model_config, "served_model_name", None) or model_config.model
    return str(name[0] if isinstance(name, list | tuple) else name)


def _attention_spec(kv_cache_config: Any, block_size: int) -> tuple[int, int]:
    """(KV heads, head size) of the engine's one full-attention cache group; ConfigError for
    a layout the connector does not serve."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise ConfigError("the prefixcache store connector needs vLLM's KV cache config")
    if len(groups) != 1:
        raise ConfigError(
            f"the prefixcache store connector serves one KV cache group; this model has "
            f"{len(groups)} (a hybrid or sliding-window model)"
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None) is not None:
        raise ConfigError(f"the prefixcache store connector serves full attention, not {kind}")
    if int(spec.block_size) != block_size:
        raise ConfigError(
            f"the KV cache group's block size {spec.block_size} differs from the engine's "
            f"{block_size}"
        )
    return int(spec.num_kv_heads), int(spec.head_size)
