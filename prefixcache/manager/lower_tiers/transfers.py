"""Transfers the manager hands back per step (host tier and shared store), and the
load-or-recompute cost model.

When to run them: after the step is planned and before its forward pass, every offload first
(they read GPU blocks that the step may hand out again), then every load; then, per layer, the
K/V stores, the copies and attention. ``PagedKVCache.start_transfers`` / ``wait_transfers`` do
exactly that for the host tier; a store connector runs the store loads. Write-throughs to the
store come after the step (``StoreWrite``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from prefixcache.blocks.namespace import Namespace


class Offload(NamedTuple):
    """Copy GPU block ``gpu_block`` into host slot ``host_slot`` (K and V, every layer)."""

    gpu_block: int
    host_slot: int


class Load(NamedTuple):
    """Copy host slot ``host_slot`` into GPU block ``gpu_block`` (K and V, every layer)."""

    host_slot: int
    gpu_block: int


class StoreLoad(NamedTuple):
    """Load the stored block ``digest`` (of ``namespace``) into GPU block ``gpu_block`` (K and
    V, every layer) for ``request_id``; a load that fails means aborting that request."""

    request_id: Hashable
    digest: bytes
    gpu_block: int
    namespace: Namespace


class StoreWrite(NamedTuple):
    """Write GPU block ``gpu_block`` to the store as ``digest`` (of ``namespace``); its K/V is
    written: the step that computed it has ended. ``parent`` is the digest of the block before
    it in its chain (None: the chain's first) and ``block_index`` its index in the chain, so a
    store can keep whole chains (a block whose parent it no longer holds cannot be loaded)."""

    digest: bytes
    gpu_block: int
    namespace: Namespace
    parent: bytes | None = None
    block_index: int = 0


class Transfers(NamedTuple):
    """The transfers of the operations planned since the last ``take_transfers()``: run every
    offload, then every load (host and store), before the forward pass reads or writes K/V."""

    offloads: list[Offload]
    loads: list[Load]
    store_loads: list[StoreLoad] = []  # noqa: RUF012  # never mutated: a fresh list per step


class TransferModel(NamedTuple):
    """Costs that decide whether a host run is loaded or recomputed.

    A run of ``b`` blocks (``n = b * block_size`` tokens) after ``c`` cached context tokens is
    loaded when ``b * bytes_per_block / host_bandwidth`` (seconds to copy it in) is below
    ``(n * flops_per_token + flops_per_pair * (n * c + n * (n + 1) / 2)) / flops`` (seconds to
    recompute it: the dense layers, and causal attention over the context and the run itself).
    Copying grows with the run; recomputing also with how deep in the sequence it sits.
    """

    bytes_per_block: float  # K and V bytes of one block across all layers
    host_bandwidth: float  # host -> device bytes per second
    flops_per_token: float  # prefill FLOPs per token, outside attention
    flops: float  # device FLOPs per second
    flops_per_pair: float = 0.0  # attention FLOPs per query-key pair, all layers

    def should_load(self, blocks: int, block_size: int, start: int = 0) -> bool:
        """Whether loading ``blocks`` blocks that follow ``start`` cached blocks costs less
        time than recomputing them."""
        n, context = blocks * block_size, start * block_size
        copy_s = blocks * self.bytes_per_block / self.host_bandwidth
        pairs = n * context + n * (n + 1) // 2
        compute_s = (n * self.flops_per_token + pairs * self.flops_per_pair) / self.flops
        return copy_s < compute_s
