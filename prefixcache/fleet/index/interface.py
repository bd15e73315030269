"""What a fleet-wide prefix index answers: which replicas hold which leading blocks of a prompt.

Blocks are keyed by prefixcache's own chained digests (see ``prefixcache.blocks.hashing``), so the
namespace (model, adapter, salt, extra keys) is part of every key and a match never crosses
namespaces. Each replica's holdings are prefix-closed, as an engine's cache is: a replica that
holds block ``i`` of a chain holds blocks ``0..i-1`` too, so "leading blocks held" is a single
number per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from prefixcache.medium import CPU, GPU

MEDIA = (GPU, CPU)  # what the index tells apart: on the GPU, or anywhere else (CPU)


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


class EngineBlock(NamedTuple):
    """What a shared index remembers of one engine block hash of a replica."""

    digest: bytes  # prefixcache's digest of the block
    position: int  # the block's position in its chain
    media: int  # where the replica holds it now, a mask: 1 GPU, 2 CPU, 3 both, 0 nowhere


class AppliedBatch(NamedTuple):
    """The last event batch of a replica's stream that a router applied to a shared index."""

    seq: int
    ts: float  # the batch's own timestamp: a lower number on a newer batch is a new stream


@runtime_checkable
class SharedEngineMap(Protocol):
    """Kept by an index that outlives a router (Redis): each replica's engine hash -> block and
    the last event batch applied, so a router that joins a stream midway (a restart, a new
    instance) replays only the batches the index missed and can still map the removals and
    continuations of blocks stored before it came. Engine hashes are passed as bytes."""

    def remember(
        self, replica: str, engine_keys: Sequence[bytes], digests: Sequence[bytes], position: int
    ) -> None:
        """``engine_keys[k]`` is the block ``digests[k]``, at ``position + k``."""

    def forget(self, replica: str, engine_keys: Sequence[bytes]) -> None:
        """The replica holds these blocks nowhere any more."""

    def recall(self, replica: str, engine_keys: Sequence[bytes]) -> dict[bytes, EngineBlock] | None:
        """The remembered ones of ``engine_keys`` (one round trip; None when the index cannot
        say now, e.g. unreachable)."""

    def adopt(self, replica: str, limit: int | None = None) -> dict[bytes, EngineBlock] | None:
        """Every remembered block the replica still holds, by engine key (at most ``limit``;
        O(its blocks); None when the index cannot say now): what a router joining the stream
        starts from."""

    def note_applied(self, replica: str, seq: int, ts: float) -> None:
        """The replica's event batches up to ``seq`` (stamped ``ts``) are applied (written
        lazily)."""

    def last_applied(self, replica: str) -> AppliedBatch | None:
        """The last batch of the replica's stream some router applied (None: unknown)."""

    def attach_engine_source(
        self, source: Callable[[str], list[tuple[bytes, bytes, int]]] | None
    ) -> None:
        """``source(replica)``: the (engine key, digest, position) of each block the caller
        knows the replica holds, to write the map back if the index loses it."""
