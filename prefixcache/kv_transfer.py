"""Block copies between the paged K/V and host memory, in batches.

A step's (host id, device block) pairs are planned once for every layer: deduplicated by the
caller, sorted by host id, and split into runs of consecutive ids. Each layer's K and V then move
with a few large copies instead of one per block. How (``TransferMode``):

- ``"runs"``: one copy per run whose host ids and device ids are both consecutive. On the CPU
  this is the fastest (a memcpy per run; for scattered ids, per block as before); on a GPU one
  DMA per run, straight between the host tensor and the paged K/V.
- ``"staged"``: the device side goes through a staging tensor on the device: offloads gather
  their blocks into it (``index_select``) and copy it out one DMA per run of consecutive host
  ids; loads copy into it, one DMA per host run, and scatter it (``index_copy_``). On a GPU the
  gather and the scatter run at device-memory speed, so scattered block ids cost the link
  nothing; only the host side's runs count.
- ``"blocks"``: one copy per block, the reference the others are checked against.
- ``"auto"``: ``"runs"`` on the CPU; on a GPU, ``"staged"`` when that needs fewer DMAs than
  ``"runs"``.

Host-side gathers (a CPU copy into pinned staging) are never used for the host tier: a host slot
may still be the target of an offload queued on the GPU's side stream, which only the stream
orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from prefixcache.errors import InvalidArgumentError

TransferMode = Literal["auto", "runs", "staged", "blocks"]
TRANSFER_MODES: tuple[str, ...] = ("auto", "runs", "staged", "blocks")


@dataclass(frozen=True, slots=True)
class BlockPairs:
    """(host id, device block) pairs sorted by host id, and their runs.

    A run is ``(first pair, count)``: ``host_runs`` where the host ids are consecutive,
    ``both_runs`` where the host ids and the device ids both are."""

    host: list[int]
    device: list[int]
    host_runs: list[tuple[int, int]]
    both_runs: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.host)

    def dma_count(self, mode: str) -> int:
        """Copies across the link per tensor in ``mode`` (``"staged"``, ``"runs"``, other:
        one per block)."""
        if mode == "staged":
            return len(self.host_runs)
        if mode == "runs":
            return len(self.both_runs)
        return len(self.host)


def plan_pairs(host: Sequence[int], device: Sequence[int]) -> BlockPairs:
    """Sort ``(host[i], device[i])`` by host id (ties keep their order) and find the runs."""
    if len(host) <= _SMALL:  # plain Python beats numpy's call overheads here
        order = sorted(zip(host, device, strict=True), key=_first)
        hs = [int(h) for h, _ in order]
        ds = [int(d) for _, d in order]
        host_runs: list[tuple[int, int]] = []
        both_runs: list[tuple[int, int]] = []
        for i, h in enumerate(hs):
            if i and h == hs[i - 1] + 1:
                first, n = host_runs[-1]
                host_runs[-1] = (first, n + 1)
                if ds[i] == ds[i - 1] + 1:
                    first, n = both_runs[-1]
                    both_runs[-1] = (first, n + 1)
                    continue
            else:
                host_runs.append((i, 1))
            both_runs.append((i, 1))
        return BlockPairs(hs, ds, host_runs, both_runs)
    host_ids = np.asarray(host, dtype=np.int64).reshape(-1)
    device_ids = np.asarray(device, dtype=np.int64).reshape(-1)
    if not len(host_ids):
        return BlockPairs([], [], [], [])
    order_np = np.argsort(host_ids, kind="stable")
    host_ids, device_ids = host_ids[order_np], device_ids[order_np]
    host_step = np.diff(host_ids) == 1
    both_step = host_step & (np.diff(device_ids) == 1)
    return BlockPairs(host_ids.tolist(), device_ids.tolist(), _runs(host_step), _runs(both_step))


_SMALL = 64  # pairs planned in plain Python (numpy costs about 30 us a call)


def _first(pair: tuple[int, int]) -> int:
    return pair[0]


def _runs(continues: np.ndarray) -> list[tuple[int, int]]:
    """``(first, count)`` runs of ``len(continues) + 1`` items, where ``continues[i]`` says
    item ``i + 1`` extends item ``i``'s run."""
    starts = np.flatnonzero(~continues) + 1
    bounds = np.concatenate(([0], starts, [len(continues) + 1]))
    return list(zip(bounds[:-1].tolist(), np.diff(bounds).tolist(), strict=True))


def resolve_mode(mode: str, pairs: BlockPairs, on_cuda: bool) -> str:
    """The mode ``"auto"`` stands for here (other modes as given)."""
    if mode != "auto":
        return mode
    if on_cuda and pairs.dma_count("staged") < pairs.dma_count("runs"):
        return "staged"
    return "runs"


def device_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``. On a GPU it goes through pinned memory with a
    copy queued on the current stream, so the host never waits for the stream's earlier work
    (a copy from pageable memory would)."""
    index = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def offload_blocks(
    device_t: torch.Tensor,
    host_t: torch.Tensor,
    pairs: BlockPairs,
    mode: str,
    *,
    index: torch.Tensor | None = None,
    stage: torch.Tensor | None = None,
    non_blocking: bool = False,
) -> None:
    """``host_t[host[i]] = device_t[device[i]]`` for every pair. ``"staged"`` needs ``index``
    (``pairs.device`` on the device) and may take ``stage`` (``[len(pairs), *block]`` on the
    device, reused)."""
    host, dev = pairs.host, pairs.device
    if mode == "blocks":
        for h, d in zip(host, dev, strict=True):
            host_t[h].copy_(device_t[d], non_blocking=non_blocking)
    elif mode == "runs":
        for first, n in pairs.both_runs:
            h, d = host[first], dev[first]
            if n == 1:  # indexing costs less than slicing
                host_t[h].copy_(device_t[d], non_blocking=non_blocking)
            else:
                host_t[h : h + n].copy_(device_t[d : d + n], non_blocking=non_blocking)
    elif mode == "staged":
        assert index is not None
        if stage is None:
            stage = device_t.index_select(0, index)
        else:
            torch.index_select(device_t, 0, index, out=stage)
        for first, n in pairs.host_runs:
            h = host[first]
            host_t[h : h + n].copy_(stage[first : first + n], non_blocking=non_blocking)
    else:
        raise ValueError(f"unknown transfer mode {mode!r}")


def load_blocks(
    device_t: torch.Tensor,
    host_t: torch.Tensor,
    pairs: BlockPairs,
    mode: str,
    *,
    index: torch.Tensor | None = None,
    stage: torch.Tensor | None = None,
    non_blocking: bool = False,
) -> None:
    """``device_t[device[i]] = host_t[host[i]]`` for every pair (device blocks distinct).
    ``"staged"`` needs ``index`` and may take ``stage``, as ``offload_blocks``."""
    host, dev = pairs.host, pairs.device
    if mode == "blocks":
        for h, d in zip(host, dev, strict=True):
            device_t[d].copy_(host_t[h], non_blocking=non_blocking)
    elif mode == "runs":
        for first, n in pairs.both_runs:
            h, d = host[first], dev[first]
            if n == 1:
                device_t[d].copy_(host_t[h], non_blocking=non_blocking)
            else:
                device_t[d : d + n].copy_(host_t[h : h + n], non_blocking=non_blocking)
    elif mode == "staged":
        assert index is not None
        if stage is None:
            stage = torch.empty(
                (len(host), *device_t.shape[1:]), dtype=device_t.dtype, device=device_t.device
            )
        for first, n in pairs.host_runs:
            h = host[first]
            stage[first : first + n].copy_(host_t[h : h + n], non_blocking=non_blocking)
        device_t.index_copy_(0, index, stage)
    else:
        raise ValueError(f"unknown transfer mode {mode!r}")


def last_of_each(ids: Sequence[int]) -> list[int]:
    """Positions of the last occurrence of each id, in order of position (a block written twice
    keeps its last value)."""
    last: dict[int, int] = {}
    for i, x in enumerate(ids):
        last[x] = i
    return sorted(last.values())


def check_block_rows(
    rows: torch.Tensor, offset: int, count: int, row_bytes: int, itemsize: int
) -> None:
    """InvalidArgumentError unless ``rows`` is a uint8 CPU tensor of ``count`` rows, each with
    ``row_bytes`` from byte ``offset``, rows and offset aligned to ``itemsize``."""
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dtype != torch.uint8
        or rows.device.type != "cpu"
        or rows.dim() != 2
        or rows.shape[0] != count
        or rows.stride(1) != 1
        or isinstance(offset, bool)
        or not isinstance(offset, int)
        or offset < 0
        or rows.shape[1] < offset + row_bytes
    ):
        raise InvalidArgumentError(
            f"rows must be a uint8 CPU tensor [{count}, >= offset + {row_bytes}] with its bytes "
            f"in rows, and offset an int >= 0; got {_describe(rows)}, offset {offset!r}"
        )
    if offset % itemsize or rows.stride(0) % itemsize:
        raise InvalidArgumentError(
            f"offset and the row length must be multiples of {itemsize} bytes (the storage "
            f"dtype's), got offset {offset} and rows of {rows.stride(0)} bytes"
        )


def block_rows_view(
    rows: torch.Tensor, offset: int, num_layers: int, like: torch.Tensor
) -> torch.Tensor:
    """``rows[:, offset:]`` as [n, num_layers, 2, *block] of ``like``'s dtype (a view; ``like``
    is one layer's K, [num_blocks, *block])."""
    row_bytes = 2 * num_layers * like[0].numel() * like.element_size()
    part = rows[:, offset : offset + row_bytes].view(like.dtype)
    return part.view(len(rows), num_layers, 2, *like.shape[1:])


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {value.device.type} tensor {tuple(value.shape)}"
    return repr(value)
