"""Paged K/V storage: per layer, K and V [num_blocks, block_size, num_kv_heads, head_dim].

With ``host_blocks=N`` it also holds the host tier's K/V, per layer [N, block_size, ...] on the
CPU (pinned when CUDA is available), and runs the manager's ``take_transfers()``:
``start_transfers`` issues every layer's offloads then loads, each layer's as a few batched copies
(``kv_transfer.py``; on a side CUDA stream, one event per layer; synchronous on the CPU), and the
forward pass calls ``wait_transfers(layer)`` before that layer's K/V store. Whole blocks of every
layer move in and out of host rows with ``write_block_rows`` / ``read_block_rows`` (a shared
store's loads and write-through), batched the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from prefixcache.errors import ConfigError, InvalidArgumentError, KernelInputError
from prefixcache.kernels.validation import check_fp8_scales
from prefixcache.kv_transfer import (
    TRANSFER_MODES,
    BlockPairs,
    TransferMode,
    block_rows_view,
    check_block_rows,
    device_index,
    last_of_each,
    load_blocks,
    offload_blocks,
    plan_pairs,
    resolve_mode,
)


class _Batch(NamedTuple):
    """One direction of a step's transfers, as every layer runs it."""

    pairs: BlockPairs
    mode: str
    on_device: torch.Tensor | None  # the device blocks, on the device ("staged")
    stage: torch.Tensor | None  # [len(pairs), *block] on the device ("staged")


class PagedKVCache:
    """The physical K/V blocks a CacheManager hands out. slot = block * block_size + offset.

    ``kv_dtype="fp8"`` stores e4m3 values as uint8 (half the bytes of fp16) with per-layer,
    per-tensor scales ``k_scale[layer]`` / ``v_scale[layer]``: a stored value ``x`` holds
    ``x / scale`` rounded to e4m3 and saturated to +-448. ``dtype`` is then the compute dtype
    that ``gather`` returns; pass the scales to ``store_kv`` and ``paged_attention``.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        fill: float = 0.0,
        kv_dtype: Literal["auto", "fp8"] = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        host_blocks: int = 0,
    ) -> None:
        sizes = []
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            try:
                size = _as_id(value)  # ints and numpy integers, not bools
            except TypeError:
                size = 0
            if size < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
            sizes.append(size)
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = sizes
        if kv_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_dtype must be 'auto' or 'fp8', got {kv_dtype!r}")
        try:  # as the kernels check them, raised as a configuration error
            k_scale, v_scale = check_fp8_scales(k_scale, v_scale)
        except KernelInputError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(host_blocks, int) or isinstance(host_blocks, bool) or host_blocks < 0:
            raise ConfigError(f"host_blocks must be an int >= 0, got {host_blocks!r}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.k_scale = [float(k_scale)] * num_layers
        self.v_scale = [float(v_scale)] * num_layers
        if kv_dtype == "fp8":
            from prefixcache.kernels.reference import quantize_fp8

            def make(scale: float) -> torch.Tensor:
                byte = quantize_fp8(torch.tensor([fill]), scale).view(torch.uint8)
                return byte.to(device).expand(shape).contiguous()

            self.k = [make(k_scale) for _ in range(num_layers)]
            self.v = [make(v_scale) for _ in range(num_layers)]
        else:
            self.k = [
                torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)
            ]
            self.v = [
                torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)
            ]
        self.host_blocks = host_blocks
        on_cuda = self.k[0].device.type == "cuda"
        host_shape = (host_blocks, block_size, num_kv_heads, head_dim)
        pin = host_blocks > 0 and torch.cuda.is_available()
        storage = self.k[0].dtype  # fp8 caches keep their bytes on host too
        self.k_host = [
            torch.zeros(host_shape, dtype=storage, pin_memory=pin) for _ in range(num_layers)
        ]
        self.v_host = [
            torch.zeros(host_shape, dtype=storage, pin_memory=pin) for _ in range(num_layers)
        ]
        self._stream: Any = (
            torch.cuda.Stream(device=self.k[0].device) if on_cuda and host_blocks else None
        )
        self._events: list[Any] = []  # per layer, of the transfers started last
        self._transfer_mode: TransferMode = "auto"

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
    ) -> int:
        """K and V bytes of one block across all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: Sequence[int] | np.ndarray | torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` [n, num_kv_heads, head_dim] at ``slots`` [n] (slot -1 = skip).

        Any block size and head size; a runtime's hot path calls ``prefixcache.kernels.store_kv``
        on the same tensors instead (the Triton kernel on CUDA).
        """
        from prefixcache.kernels.reference import reference_store_kv

        self._check_layer(layer)
        slots_t = torch.as_tensor(slots, device=k.device)
        if (
            slots_t.dtype.is_floating_point
            or slots_t.dtype.is_complex
            or slots_t.dtype == torch.bool
        ):
            raise InvalidArgumentError(f"slots must be integer ids, got dtype {slots_t.dtype}")
        slots_t = slots_t.to(torch.int64).reshape(-1)
        if (
            k.shape != v.shape
            or k.shape[0] != slots_t.numel()
            or k.shape[1:] != self.k[layer].shape[2:]
        ):
            _, _, hkv, d = self.k[layer].shape
            raise InvalidArgumentError(
                f"k/v must be [{slots_t.numel()}, {hkv}, {d}] to match the slots, "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if slots_t.numel():
            lo, hi = int(slots_t.min()), int(slots_t.max())
            if lo < -1:
                raise InvalidArgumentError(f"slot {lo} is invalid: slots are >= 0, or -1 to skip")
            if hi >= self.num_blocks * self.block_size:
                raise InvalidArgumentError(f"slot {hi} is outside the cache")
        scales = (self.k_scale[layer], self.v_scale[layer]) if self.fp8 else (None, None)
        reference_store_kv(
            k, v, self.k[layer], self.v[layer], slots_t, k_scale=scales[0], v_scale=scales[1]
        )

    def apply_copies(
        self, copies: Iterable[tuple[int, int, int]], layer: int | None = None
    ) -> None:
        """Run the manager's (src, dst, num_slots) copies in order, on ``layer`` or on all.

        In a forward pass, run each layer's copies after its K/V store and before its attention.
        Every copy is checked before any runs.
        """
        if layer is not None:
            self._check_layer(layer)
        try:
            copies = list(copies)
        except TypeError:
            raise InvalidArgumentError(
                f"copies must be an iterable of (src, dst, num_slots), got {copies!r}"
            ) from None
        for copy in copies:
            try:
                src, dst, n = (_as_id(x) for x in copy)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"a copy is (src, dst, num_slots) of ints, got {copy!r}"
                ) from None
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise InvalidArgumentError(
                    f"copy {copy!r}: block ids must be in [0, {self.num_blocks})"
                )
            if not 0 <= n <= self.block_size:
                raise InvalidArgumentError(
                    f"copy {copy!r}: num_slots must be in [0, {self.block_size}]"
                )
        caches = (*self.k, *self.v) if layer is None else (self.k[layer], self.v[layer])
        for src, dst, n in copies:
            for cache in caches:
                cache[dst, :n] = cache[src, :n]

    def gather(
        self, layer: int, block_table: Sequence[int] | torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V, each [length, num_kv_heads, head_dim], read through its table.

        fp8 caches are dequantized to the compute ``dtype``.
        """
        from prefixcache.kernels.reference import dequantize_fp8, gather_kv

        self._check_layer(layer)
        try:
            table = torch.as_tensor(block_table, device=self.k[layer].device)
        except (TypeError, ValueError, RuntimeError):
            table = torch.empty(0, 0)  # refused just below
        integer = not (
            table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool
        )
        if table.dim() != 1 or not (integer or table.numel() == 0):  # [] reads as float
            raise InvalidArgumentError(
                f"block_table must be a 1-D sequence of integer block ids, got {block_table!r}"
            )
        table = table.to(torch.int64).reshape(-1)
        need = -(-length // self.block_size)
        used = table[:need]
        if length < 0 or used.numel() < need:
            raise InvalidArgumentError(
                f"{length} tokens need {need} blocks but the table has {used.numel()}"
            )
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= self.num_blocks):
            raise InvalidArgumentError("block table has padding or a bad id inside the length")
        k, v = gather_kv(self.k[layer], used, length), gather_kv(self.v[layer], used, length)
        if self.fp8:
            k = dequantize_fp8(k, self.k_scale[layer]).to(self.dtype)
            v = dequantize_fp8(v, self.v_scale[layer]).to(self.dtype)
        return k, v

    @property
    def transfer_mode(self) -> TransferMode:
        """How ``start_transfers`` moves blocks (``prefixcache.kv_transfer``): ``"auto"`` (the
        default) picks per device and step; ``"runs"``, ``"staged"`` and ``"blocks"`` (one copy
        per block) force one way, to compare or test them."""
        return self._transfer_mode

    @transfer_mode.setter
    def transfer_mode(self, mode: TransferMode) -> None:
        if mode not in TRANSFER_MODES:
            raise ConfigError(f"transfer_mode must be one of {TRANSFER_MODES}, got {mode!r}")
        self._transfer_mode = mode

    def start_transfers(self, transfers: Sequence[Iterable[Any]]) -> None:
        """Issue a step's transfers (``CacheManager.take_transfers()``): per layer, every
        offload (GPU block -> host slot), then every load (host slot -> GPU block).

        Each layer's offloads move as one batch and its loads as another (runs of consecutive
        ids copied whole; on a GPU, scattered blocks gathered or scattered on the device), the
        same bytes as copying block by block in order. On CUDA they run on a side stream after
        the work queued so far, one event per layer; call ``wait_transfers(layer)`` before the
        layer's K/V store. On the CPU they are done when this returns. Validates every id
        before copying anything.
        """
        try:
            offloads, loads = transfers[0], transfers[1]  # a store connector runs store loads
            if len(transfers) not in (2, 3):
                raise ValueError(transfers)
            pairs = [
                [(_as_id(a), _as_id(b)) for a, b in part]
                for part in (offloads, loads)  # (gpu, host) then (host, gpu)
            ]
        except (TypeError, ValueError, IndexError, KeyError):
            raise InvalidArgumentError(
                "transfers must be (offloads, loads[, store_loads]): (gpu_block, host_slot) and "
                f"(host_slot, gpu_block) pairs of ints, got {transfers!r}"
            ) from None
        off = {host: gpu for gpu, host in pairs[0]}  # a slot written twice keeps the last
        load = {gpu: host for host, gpu in pairs[1]}  # a block written twice keeps the last
        for gpu, host in (*((g, h) for h, g in off.items()), *load.items()):
            if not 0 <= gpu < self.num_blocks:
                raise InvalidArgumentError(
                    f"block {gpu} is outside the cache (blocks 0..{self.num_blocks - 1}); give "
                    "PagedKVCache the manager's num_blocks"
                )
            if not 0 <= host < self.host_blocks:
                raise InvalidArgumentError(
                    f"host slot {host} is outside the host tier ({self.host_blocks} slots); give "
                    "PagedKVCache the same host_blocks as the CacheManager"
                )
        self._events = []
        if not off and not load:
            return
        out_pairs = plan_pairs(list(off), list(off.values()))
        in_pairs = plan_pairs(list(load.values()), list(load))
        if self._stream is None:  # the CPU: synchronous copies
            out, into = self._batch(out_pairs), self._batch(in_pairs)
            for layer in range(self.num_layers):
                self._copy_layer(layer, out, into, non_blocking=False)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.k[0].device))
        with torch.cuda.stream(self._stream):  # index and staging tensors belong to it
            out, into = self._batch(out_pairs), self._batch(in_pairs)
            for layer in range(self.num_layers):
                self._copy_layer(layer, out, into, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._events.append(event)

    def _batch(self, pairs: BlockPairs) -> _Batch | None:
        """How one direction's pairs move: the mode, and for ``"staged"`` the block ids on the
        device and a staging tensor that every layer's K and V reuse."""
        if not len(pairs):
            return None
        like = self.k[0]
        mode = resolve_mode(self._transfer_mode, pairs, like.device.type == "cuda")
        if mode != "staged":
            return _Batch(pairs, mode, None, None)
        index = device_index(pairs.device, like.device)
        stage = torch.empty((len(pairs), *like.shape[1:]), dtype=like.dtype, device=like.device)
        return _Batch(pairs, mode, index, stage)

    def _copy_layer(
        self, layer: int, out: _Batch | None, into: _Batch | None, *, non_blocking: bool
    ) -> None:
        """One layer's offloads (host slots <- GPU blocks), then its loads (GPU blocks <- host
        slots), K then V."""
        for gpu_t, host_t in (
            (self.k[layer], self.k_host[layer]),
            (self.v[layer], self.v_host[layer]),
        ):
            if out is not None:
                offload_blocks(
                    gpu_t, host_t, out.pairs, out.mode,
                    index=out.on_device, stage=out.stage, non_blocking=non_blocking,
                )  # fmt: skip
            if into is not None:
                load_blocks(
                    gpu_t, host_t, into.pairs, into.mode,
                    index=into.on_device, stage=into.stage, non_blocking=non_blocking,
                )  # fmt: skip

    def wait_transfers(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s transfers (nothing to wait for on the
        CPU, or when none were started)."""
        self._check_layer(layer)
        if self._events:
            torch.cuda.current_stream(self.k[0].device).wait_event(self._events[layer])

    # ---- whole blocks, every layer, in host rows (a shared store's records) ----------------
    @property
    def block_row_bytes(self) -> int:
        """Bytes of one block's K and V across all layers, in the storage dtype."""
        k = self.k[0]
        return 2 * self.num_layers * k[0].numel() * k.element_size()

    def host_rows(self, rows: int, row_bytes: int) -> torch.Tensor:
        """A new uint8 host tensor [rows, row_bytes] to fill and pass to ``write_block_rows``:
        pinned when the cache is on CUDA, so the copy to the device runs asynchronously."""
        pin = self.k[0].device.type == "cuda"
        return torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pin)

    def write_block_rows(self, blocks: Sequence[int], rows: torch.Tensor, offset: int = 0) -> None:
        """Copy host rows into GPU blocks, every layer's K and V: row ``i`` of ``rows`` (uint8
        [n, row_bytes] on the CPU) holds block ``blocks[i]`` from byte ``offset`` as [num_layers,
        2 (K, V), block_size, num_kv_heads, head_dim] in the storage dtype (a store record's
        payload). A block named twice keeps its last row.

        On CUDA one copy takes the rows to the device and each layer's K and V are scattered
        with one ``index_copy_``, after the work queued so far: on the side stream when the cache
        has a host tier (its per-layer events then cover these copies too: ``wait_transfers``),
        else on the current stream. The copy may still be reading ``rows`` when this returns:
        pass a fresh tensor (``host_rows``) each call and leave it unchanged. On the CPU the
        copies are done when this returns.
        """
        ids, payload = self._rows_args(blocks, rows, offset)
        if not ids:
            return
        keep = last_of_each(ids)
        if len(keep) < len(ids):  # a block named twice
            ids = [ids[i] for i in keep]
        device = self.k[0].device
        if device.type != "cuda":
            if len(keep) < len(payload):
                payload = payload[torch.tensor(keep)]
            pairs = plan_pairs(range(len(ids)), ids)  # row i -> block ids[i]
            mode = resolve_mode(self._transfer_mode, pairs, on_cuda=False)
            index = torch.tensor(pairs.device) if mode == "staged" else None
            for layer, both in enumerate(payload.unbind(1)):  # views made at once: cheaper
                for cache, part in zip((self.k[layer], self.v[layer]), both.unbind(1), strict=True):
                    load_blocks(cache, part, pairs, mode, index=index)
            return
        current = torch.cuda.current_stream(device)
        stream = self._stream if self._stream is not None else current
        if self._stream is not None:
            self._stream.wait_stream(current)
        with torch.cuda.stream(stream):
            dev_rows = rows.contiguous().to(device, non_blocking=True)  # one copy
            on_dev = self._payload_view(dev_rows, offset)
            if len(keep) < len(on_dev):
                on_dev = on_dev.index_select(0, device_index(keep, device))
            index = device_index(ids, device)
            events = []
            for layer in range(self.num_layers):
                self.k[layer].index_copy_(0, index, on_dev[:, layer, 0])
                self.v[layer].index_copy_(0, index, on_dev[:, layer, 1])
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
            if events:  # later on the same stream: they cover the step's host transfers too
                self._events = events

    def read_block_rows(self, blocks: Sequence[int], rows: torch.Tensor, offset: int = 0) -> None:
        """Copy GPU blocks into host rows, every layer's K and V: the inverse of
        ``write_block_rows`` (row ``i`` gets block ``blocks[i]`` from byte ``offset``). Reads
        after the work queued so far (host transfers included); done when this returns.
        """
        ids, payload = self._rows_args(blocks, rows, offset)
        if not ids:
            return
        device = self.k[0].device
        if device.type != "cuda":
            pairs = plan_pairs(range(len(ids)), ids)  # row i <- block ids[i]
            mode = resolve_mode(self._transfer_mode, pairs, on_cuda=False)
            index = torch.tensor(pairs.device) if mode == "staged" else None
            for layer, both in enumerate(payload.unbind(1)):
                for cache, part in zip((self.k[layer], self.v[layer]), both.unbind(1), strict=True):
                    offload_blocks(cache, part, pairs, mode, index=index)
            return
        current = torch.cuda.current_stream(device)
        if self._stream is not None:
            current.wait_stream(self._stream)
        index = device_index(ids, device)
        like = self.k[0]
        gathered = torch.empty(
            (self.num_layers, 2, len(ids), *like.shape[1:]), dtype=like.dtype, device=device
        )
        for layer in range(self.num_layers):  # contiguous slices: one gather each
            torch.index_select(self.k[layer], 0, index, out=gathered[layer, 0])
            torch.index_select(self.v[layer], 0, index, out=gathered[layer, 1])
        ordered = gathered.permute(2, 0, 1, *range(3, gathered.dim())).contiguous()
        if payload.is_contiguous():
            payload.copy_(ordered)  # one copy to the host, waited for
        else:  # rows with headers: one copy to pinned memory, then into the rows
            staged = torch.empty(ordered.shape, dtype=like.dtype, pin_memory=True)
            staged.copy_(ordered)
            payload.copy_(staged)

    def _rows_args(
        self, blocks: Sequence[int], rows: torch.Tensor, offset: int
    ) -> tuple[list[int], torch.Tensor]:
        """The block ids and the rows' payload view [n, num_layers, 2, *block], checked."""
        try:
            ids = [_as_id(b) for b in blocks]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"blocks must be int block ids, got {blocks!r}") from None
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise InvalidArgumentError(
                    f"block {b} is outside the cache (blocks 0..{self.num_blocks - 1})"
                )
        check_block_rows(rows, offset, len(ids), self.block_row_bytes, self.k[0].element_size())
        return ids, self._payload_view(rows, offset)

    def _payload_view(self, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """``rows[:, offset:]`` as [n, num_layers, 2, *block] of the storage dtype (a view)."""
        return block_rows_view(rows, offset, self.num_layers, self.k[0])

    def _check_layer(self, layer: object) -> None:
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise InvalidArgumentError(
                f"layer must be an int in [0, {self.num_layers}), got {layer!r}"
            )


def _as_id(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)
