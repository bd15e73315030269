"""The store connector's counters in vLLM: ``KVConnectorStats`` and Prometheus counters.

Each role hands vLLM the counts that moved since its last step (``StoreTally.take_delta``);
vLLM sums the workers' and the scheduler's (``aggregate``), logs the sums of each logging
interval as ``KV Transfer metrics: loaded_blocks=..., refused_checksum=...`` (``reduce``), and
its Prometheus logger adds them to counters named ``vllm:prefixcache_store_<name>_total`` on
the server's ``/metrics``, labelled like vLLM's own (model name, engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from prefixcache.engines.vllm.connector_tally import COUNTERS
from prefixcache.store.block_record import Refusal

PROM_PREFIX = "vllm:prefixcache_store_"
PROM_COUNTERS = (*COUNTERS, *(f"refused_{r.value}" for r in Refusal))


@dataclass
class StoreConnectorStats(KVConnectorStats):
    """Counts of one interval, ``data`` mapping a counter's name to its count."""

    def reset(self) -> None:
        """Count from zero."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """The sum of both (workers' and scheduler's, or two intervals)."""
        summed = dict(self.data)
        for name, n in other.data.items():
            summed[name] = summed.get(name, 0) + n
        return StoreConnectorStats(data=summed)

    def reduce(self) -> dict[str, int | float]:
        """The interval's counts, for vLLM's log line."""
        return {name: int(n) for name, n in sorted(self.data.items()) if n}

    def is_empty(self) -> bool:
        """Nothing counted."""
        return not any(self.data.values())


class StorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per store counter, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name in PROM_COUNTERS:
            counter = self._counter_cls(
                name=f"{PROM_PREFIX}{name}",
                documentation=f"prefixcache store connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[(engine, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts."""
        for name, n in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and n:
                counter.inc(n)
