"""Live what-if curves: the prompts the router sends to each replica, sampled (``shards``), give
the hit rate that replica would have with more or less KV memory, and all prompts together the
hit rate of one cache of the fleet's total size (the pooled line).

Each curve is read on a grid of ``FACTORS`` times the replica's ``capacity_blocks`` (the fleet's:
their sum). Past 1x a point is what the same traffic would hit with that much more cache: GPU
memory, or a host tier or a pool that held it. The estimate assumes LRU eviction (leaves first)
and the router's own digests; it covers the traffic since the service started. The fleet's
curve needs one block size (a cache's blocks are of one size, and a prompt's digests differ by
block size): with replicas of several it has no points and names them (``mixed_block_sizes``);
each replica's curve answers as ever.

Memory is bounded: ``max_memory_mib`` is shared by the curves (each replica's and the fleet's):
each sample has its fixed part (``FIXED_BYTES``: histograms and counts) and is bounded in blocks
within the rest, its sampling rate lowered as it fills (``shards``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.shards import (
    FIXED_BYTES,
    MAX_BLOCKS,
    MIN_SAMPLED_BLOCKS,
    ShardsSampler,
    sampled_hashes,
)

FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
BYTES_PER_SAMPLED_BLOCK = 320  # dict, heap, ints, 4 slots in each of 2 trees (301 measured)
FLEET = "fleet"  # the name of the curve of every prompt as one cache


@dataclass(frozen=True)
class WhatIfConfig:
    """How the live curves sample."""

    enabled: bool = True
    rate: float = 0.01  # blocks sampled, at first (lowered as a sample fills)
    max_memory_mib: float = 64.0  # shared by every curve


class LiveCurves:
    """One sample per replica and one for the fleet, fed by the router (``observe``); read by
    ``snapshot``. Thread-safe."""

    def __init__(self, config: WhatIfConfig, replicas: Callable[[], Sequence[ReplicaSpec]]) -> None:
        self.config = config
        self._replicas = replicas
        self._lock = threading.Lock()
        self._samples: dict[str, ShardsSampler] = {}  # by replica
        self._fleet: ShardsSampler | None = None  # every prompt, as one cache
        self._mixed: set[int] = set()  # block sizes routed to besides the fleet curve's
        self._requests: dict[str, int] = {}
        self.since = time.time()

    def _max_blocks(self) -> int:
        curves = len(self._replicas()) + 1
        budget = self.config.max_memory_mib * (1 << 20) - curves * FIXED_BYTES
        return min(MAX_BLOCKS, max(256, int(budget / (curves * BYTES_PER_SAMPLED_BLOCK))))

    def observe(
        self,
        replica: str,
        digests: Sequence[bytes],
        prompt_tokens: int,
        block_size: int,
    ) -> None:
        """A routed prompt (its digests at the replica's ``block_size``, root first)."""
        if not self.config.enabled:
            return
        with self._lock:
            sample = self._samples.get(replica)
            if sample is None:
                sample = self._samples[replica] = self._new_sample(block_size)
            fleet = self._fleet
            if fleet is None:
                fleet = self._fleet = self._new_sample(block_size)
            # one pass picks what either sample takes; each then keeps its own
            chain = digests if isinstance(digests, list) else list(digests)
            hashes = sampled_hashes(chain, max(sample.threshold, fleet.threshold))
            sample.reference_hashes(hashes, len(digests), prompt_tokens)
            if block_size == fleet.block_size:
                fleet.reference_hashes(hashes, len(digests), prompt_tokens)
            else:
                self._mixed.add(block_size)
            self._requests[replica] = self._requests.get(replica, 0) + 1

    def _new_sample(self, block_size: int) -> ShardsSampler:
        return ShardsSampler(self.config.rate, self._max_blocks(), block_size)

    def snapshot(self) -> dict[str, Any]:
        """The curves now, for ``GET /v1/whatif``."""
        specs = list(self._replicas())
        with self._lock:
            requests = sum(self._requests.values())
            rows = [
                self._curve(
                    s.name, self._samples.get(s.name), s.capacity_blocks, s.block_size,
                    self._requests.get(s.name, 0),
                )
                for s in specs
            ]  # fmt: skip
            total = sum(s.capacity_blocks for s in specs)
            block_size = specs[0].block_size if specs else 0
            sizes = sorted({s.block_size for s in specs} | self._mixed)
            if len(sizes) > 1:  # no one cache of the fleet's memory: no points
                fleet = self._curve(FLEET, None, 0, block_size, requests)
            else:
                fleet = self._curve(FLEET, self._fleet, total, block_size, requests)
        fleet["replicas"] = len(specs)
        fleet["mixed_block_sizes"] = sizes if len(sizes) > 1 else None
        # the rate each curve samples at now: the one asked for until its bound lowers it
        running = min((row["rate"] for row in [*rows, fleet]), default=self.config.rate)
        return {
            "enabled": self.config.enabled,
            "sampling": {
                "rate": running,
                "requested_rate": self.config.rate,
                "rate_lowered": running < self.config.rate,
                "max_memory_mib": self.config.max_memory_mib,
                "max_sampled_blocks_per_curve": self._max_blocks(),
            },
            "window": {
                "since": round(self.since, 3),
                "seconds": round(time.time() - self.since, 3),
                "routed_requests": requests,
            },
            "factors": list(FACTORS),
            "replicas": rows,
            "fleet": fleet,
        }

    def _curve(
        self,
        name: str,
        sample: ShardsSampler | None,
        capacity: int,
        block_size: int,
        requests: int,
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": name,
            "capacity_blocks": capacity,
            "block_size": block_size,
            "requests": requests,
            "rate": sample.rate if sample is not None else self.config.rate,
            "sampled_blocks": sample.sampled_blocks if sample is not None else 0,
            "sampled_references": sample.sampled_refs if sample is not None else 0,
            "min_sampled_blocks": MIN_SAMPLED_BLOCKS,
            "too_few_sampled": sample is None or not sample.answers,
            "points": [],
        }
        if sample is None or capacity <= 0:
            return row
        for factor in FACTORS:
            point = sample.hit_rate(factor * capacity)
            row["points"].append(
                {
                    "factor": factor,
                    "blocks": int(point.blocks),
                    # below a sample that can answer, no figure (not a confident 0)
                    "token_hit_rate": round(point.hit_rate, 6) if point.enough else None,
                    "stderr": round(point.stderr, 6) if point.enough else None,
                }
            )
        return row

    def gauges(self) -> WhatIfGauges:
        """The curves' sampling rates and points, for the metrics."""
        snap = self.snapshot()
        rows = [*snap["replicas"], snap["fleet"]]
        points = [
            (row["name"], point["factor"], point["token_hit_rate"])
            for row in rows
            for point in row["points"]
            if point["token_hit_rate"] is not None
        ]
        rates = [(row["name"], float(row["rate"])) for row in rows]
        return WhatIfGauges(self.config.rate, rates, points)


class WhatIfGauges(NamedTuple):
    """What the metrics export of the curves."""

    requested_rate: float  # whatif.rate, as configured
    rates: list[tuple[str, float]]  # (curve, the rate it samples at now)
    points: list[tuple[str, float, float]]  # (curve, factor, token hit rate)
