"""What the connector's two sides tell each other each step.

The scheduler side sends the worker a ``StoreStepPlan`` with the step's scheduler output: the
blocks to load from the store before the forward pass, and the prompt blocks the pass computes,
to write through after it. The worker sends back a ``StoreWorkerReport`` with the step's model
output: what the store took and evicted, and the records it refused, so the scheduler can
announce them as KV events; the blocks that failed to load, so the scheduler writes them once
vLLM has computed them; and how many handed-over blocks are settled, so it knows when the
writes have drained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class BlockMove(NamedTuple):
    """One block between vLLM's cache and the store."""

    block_id: int  # vLLM's block
    digest: bytes  # the store's key
    fingerprint: bytes  # the namespace's fingerprint in the record header
    parent: bytes | None  # the digest of the block before it in the prompt (None: the first)
    block_index: int  # its place in the prompt (0 for the first block)


class RequestBlocks(NamedTuple):
    """A request's blocks to load or to write, in prompt order."""

    request_id: str
    blocks: list[BlockMove]


@dataclass
class StoreStepPlan(KVConnectorMetadata):
    """One step's loads (before the forward pass) and writes (after it)."""

    loads: list[RequestBlocks] = field(default_factory=list)
    saves: list[RequestBlocks] = field(default_factory=list)


@dataclass
class StoreWorkerReport(KVConnectorWorkerMetadata):
    """What a worker's store traffic did since its last report."""

    stored: list[bytes] = field(default_factory=list)  # digests now in the store
    evicted: list[bytes] = field(default_factory=list)  # digests the store evicted
    refused: list[bytes] = field(default_factory=list)  # digests refused on load, removed
    unloaded: list[bytes] = field(default_factory=list)  # blocks a failed load left unchecked
    settled: int = 0  # blocks handed to the writer that are done (however they ended)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both workers' reports in one."""
        assert isinstance(other, StoreWorkerReport)
        return StoreWorkerReport(
            self.stored + other.stored,
            self.evicted + other.evicted,
            self.refused + other.refused,
            self.unloaded + other.unloaded,
            self.settled + other.settled,
        )

    def is_empty(self) -> bool:
        """Nothing to tell."""
        return not (self.stored or self.evicted or self.refused or self.unloaded or self.settled)
