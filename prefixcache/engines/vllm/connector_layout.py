"""vLLM's paged K/V as store records see it: whole blocks copied out of and into the engine's
cache tensors.

A record holds a block in one order whatever engine wrote it (block_record.py): per layer, K
then V, each ``(block_size, kv_heads, head_dim)``. vLLM's CPU attention keeps one tensor per
layer of ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` elements, which it reads as
``[num_blocks, kv_heads, 2 * block_size, head_dim]``: per head, the block's K rows then its V
rows. ``PagedKV`` views each layer as ``[num_blocks, kv_heads, 2, block_size, head_dim]`` and
moves a batch of blocks out with one gather per layer (through a scratch buffer it keeps) and
in with one strided copy per block and layer, transposing heads and tokens on the way. Any
other shape (a GPU backend's, a kernel block size other than the scheduler's, a hybrid or MLA
model) is refused when the caches are registered, with what was found.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from prefixcache.errors import ConfigError
from prefixcache.store.block_record import BlockLayout


class PagedKV:
    """Every attention layer's paged K/V (``kv_caches`` in vLLM's layer order), blocks of
    ``block_size`` tokens with ``num_kv_heads`` heads of ``head_size``."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        block_size: int,
        num_kv_heads: int,
        head_size: int,
    ) -> None:
        if not kv_caches:
            raise ConfigError("the prefixcache store connector found no KV cache to serve")
        blocks = []
        dtype = None
        for name, tensor in kv_caches.items():
            expected = (tensor.shape[0], num_kv_heads, block_size, 2 * head_size)
            if tensor.dim() != 4 or tuple(tensor.shape) != expected:
                raise ConfigError(
                    f"the prefixcache store connector reads vLLM's CPU attention layout "
                    f"[num_blocks, kv_heads, block_size, 2 * head_dim] = [N, {num_kv_heads}, "
                    f"{block_size}, {2 * head_size}]; layer {name} is {list(tensor.shape)}"
                )
            if dtype is not None and tensor.dtype != dtype:
                raise ConfigError(f"layer {name} is {tensor.dtype}, the others {dtype}")
            if not tensor.is_contiguous():
                raise ConfigError(f"layer {name}'s KV cache is not one contiguous tensor")
            dtype = tensor.dtype
            blocks.append(tensor.view(tensor.shape[0], num_kv_heads, 2, block_size, head_size))
        assert dtype is not None
        self.blocks = blocks  # per layer [num_blocks, heads, 2, block_size, head_dim]
        self.num_blocks = int(blocks[0].shape[0])
        itemsize = blocks[0].element_size()
        name = str(dtype).removeprefix("torch.")
        shape = (block_size, num_kv_heads, head_size)
        self.dtype = dtype
        self.layout = BlockLayout(block_size, len(blocks), name, itemsize, shape).check()
        self._tmp = torch.empty(0, num_kv_heads, 2, block_size, head_size, dtype=dtype)

    def _scratch(self, n: int) -> torch.Tensor:
        """``n`` blocks of one layer in the cache's order, in a buffer kept between calls (a
        fresh one would cost a page fault per 4 KiB)."""
        if len(self._tmp) < n:
            self._tmp = torch.empty(n, *self._tmp.shape[1:], dtype=self.dtype)
        return self._tmp[:n]

    def payloads(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (bytes, ``[n, payload_bytes]``) as ``[n, layers, 2, block_size, heads,
        head_dim]`` elements."""
        layout = self.layout
        return buffer.view(self.dtype).view(-1, layout.num_layers, 2, *layout.shape)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``out`` (``payloads`` of ``len(block_ids)``
        records)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        tmp = self._scratch(len(block_ids))
        for layer, cache in enumerate(self.blocks):
            torch.index_select(cache, 0, ids, out=tmp)
            out[:, layer].copy_(tmp.permute(0, 2, 3, 1, 4))

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src`` (``payloads`` of ``len(block_ids)`` records) into blocks
        ``block_ids``."""
        for layer, cache in enumerate(self.blocks):  # block by block: one strided copy each,
            rows = src[:, layer].permute(0, 3, 1, 2, 4)  # half the time of index_copy_ here
            for i, block in enumerate(block_ids):
                cache[block].copy_(rows[i])
