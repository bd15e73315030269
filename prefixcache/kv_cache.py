"""Paged K/V storage: per layer, K and V [num_blocks, block_size, num_kv_heads, head_dim].

With ``host_blocks=N`` it also holds the host tier's K/V, per layer [N, block_size, ...] on the
CPU (pinned when CUDA is available), and runs the manager's ``take_transfers()``:
``start_transfers`` issues every layer's offloads then loads (on a side CUDA stream, one event per
layer; plain synchronous copies on the CPU), and the forward pass calls ``wait_transfers(layer)``
before that layer's K/V store.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from prefixcache.errors import ConfigError, InvalidArgumentError, KernelInputError
from prefixcache.kernels.validation import check_fp8_scales


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

    def start_transfers(self, transfers: Sequence[Iterable[Any]]) -> None:
        """Issue a step's transfers (``CacheManager.take_transfers()``): per layer, every
        offload (GPU block -> host slot), then every load (host slot -> GPU block), in order.

        On CUDA they run on a side stream after the work queued so far, one event per layer;
        call ``wait_transfers(layer)`` before the layer's K/V store. On the CPU they are done
        when this returns. Validates every id before copying anything.
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
        if self._stream is None:  # the CPU: synchronous copies, block by block (the fastest)
            for layer in range(self.num_layers):
                self._copy_layer(layer, off, load, non_blocking=False)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.k[0].device))
        with torch.cuda.stream(self._stream):
            for layer in range(self.num_layers):
                self._copy_layer(layer, off, load, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._events.append(event)

    def _copy_layer(
        self, layer: int, off: dict[int, int], load: dict[int, int], *, non_blocking: bool
    ) -> None:
        """One layer's offloads (host slot <- GPU block), then its loads (GPU block <- slot)."""
        for gpu_t, host_t in (
            (self.k[layer], self.k_host[layer]),
            (self.v[layer], self.v_host[layer]),
        ):
            for host, gpu in off.items():
                host_t[host].copy_(gpu_t[gpu], non_blocking=non_blocking)
            for gpu, host in load.items():
                gpu_t[gpu].copy_(host_t[host], non_blocking=non_blocking)

    def wait_transfers(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s transfers (nothing to wait for on the
        CPU, or when none were started)."""
        self._check_layer(layer)
        if self._events:
            torch.cuda.current_stream(self.k[0].device).wait_event(self._events[layer])

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
