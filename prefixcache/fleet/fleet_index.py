"""What a fleet-wide prefix index answers: which replicas hold which leading blocks of a prompt.

Blocks are keyed by prefixcache's own chained digests (see ``prefixcache.hashing``), so the
namespace (model, adapter, salt, extra keys) is part of every key and a match never crosses
namespaces. Each replica's holdings are prefix-closed, as an engine's cache is: a replica that
holds block ``i`` of a chain holds blocks ``0..i-1`` too, so "leading blocks held" is a single
number per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

GPU = "GPU"
CPU = "CPU"
MEDIA = (GPU, CPU)


class ReplicaMatch(NamedTuple):
    """How much of a prompt's block chain one replica holds."""

    replica: str
    blocks: int  # leading blocks held on any medium
    gpu_blocks: int  # leading blocks held on GPU (<= blocks)


class FleetIndex(Protocol):
    """Replica -> block-chain holdings, fed by KV events, read by the router."""

    def store(self, replica: str, digests: Sequence[bytes], medium: str = GPU) -> None:
        """``replica`` now holds the blocks ``digests`` (16-byte digests) on ``medium``."""

    def remove(self, replica: str, digests: Sequence[bytes], medium: str | None = None) -> None:
        """``replica`` dropped ``digests`` from ``medium`` (from every medium when None)."""

    def clear(self, replica: str) -> None:
        """``replica`` holds nothing any more (restart, ``AllBlocksCleared``); it stays known."""

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (removed from the fleet)."""

    def match(self, digests: Sequence[bytes]) -> list[ReplicaMatch]:
        """Leading blocks of ``digests`` each known replica holds, one entry per replica."""

    def replicas(self) -> list[str]:
        """Every replica the index knows, sorted."""

    def num_blocks(self, replica: str) -> int:
        """Blocks (on any medium) the index holds for ``replica``."""

    def num_blocks_many(self, replicas: Sequence[str], medium: str | None = None) -> dict[str, int]:
        """Blocks held by several replicas at once (one round trip for a remote index): on any
        medium (None) or on GPU only (``GPU``, what a replica's KV capacity bounds)."""
