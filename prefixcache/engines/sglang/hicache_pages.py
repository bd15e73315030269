"""SGLang's host memory pool pages as store records see them.

A record holds a page in the store's one order (block_record.py): per layer, K then V, each
``(page tokens, kv_heads, head_dim)``. SGLang's MHA host pool keeps every page in one of its
layouts, ``kv_buffer`` being:

- ``page_first`` (the default): ``[2, tokens, layers, heads, head_dim]``, a page the tokens
  ``index .. index + page_size``;
- ``layer_first``: ``[2, layers, tokens, heads, head_dim]``;
- ``page_first_direct``: ``[2, pages, layers, page_size, heads, head_dim]``;
- ``page_head``: ``[2, pages, heads, page_size, layers, head_dim]``.

``HostPages`` reads a page (``read``) into a record's payload and writes one back (``write``),
for the zero-copy interface (pages named by their first host index), and converts a record to
and from the flat page of SGLang's older interface (``get_data_page`` / ``set_from_flat_data_page``,
whose element order follows the layout). Pools it cannot read (MLA, K-only, another V width,
``page_unified``) are refused with what was found.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixcache.errors import ConfigError
from prefixcache.store.block_record import BlockLayout

LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


class HostPages:
    """The pages of one SGLang MHA host pool (``HostKVCache``), in record order."""

    def __init__(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        buffer = getattr(pool, "kv_buffer", None)
        if layout not in LAYOUTS or not isinstance(buffer, torch.Tensor):
            raise ConfigError(
                f"prefixcache's HiCache store reads SGLang's MHA host pool in layouts "
                f"{', '.join(LAYOUTS)}; got {type(pool).__name__} with layout {layout!r}"
            )
        head_dim, v_head_dim = int(pool.head_dim), int(getattr(pool, "v_head_dim", pool.head_dim))
        if head_dim != v_head_dim:
            raise ConfigError(f"K and V widths differ ({head_dim}, {v_head_dim}): not supported")
        self.pool = pool
        self.layout_name: str = layout
        self.buffer = buffer
        self.page_size = int(pool.page_size)
        self.layers = int(pool.layer_num)
        self.heads = int(pool.head_num)
        self.head_dim = head_dim
        self.dtype = buffer.dtype
        name = str(buffer.dtype).removeprefix("torch.")
        shape = (self.page_size, self.heads, self.head_dim)
        self.layout = BlockLayout(
            self.page_size, self.layers, name, buffer.element_size(), shape
        ).check()

    def _page(self, index: int) -> torch.Tensor:
        """The page starting at host index ``index`` as ``[layers, 2, page, heads, head_dim]``
        (a view into the pool)."""
        b, p = self.buffer, self.page_size
        if self.layout_name == "page_first":  # [2, P, L, H, D]
            return b[:, index : index + p].permute(2, 0, 1, 3, 4)
        if self.layout_name == "layer_first":  # [2, L, P, H, D]
            return b[:, :, index : index + p].permute(1, 0, 2, 3, 4)
        page = index // p
        if self.layout_name == "page_first_direct":  # [2, L, P, H, D]
            return b[:, page].permute(1, 0, 2, 3, 4)
        return b[:, page].permute(3, 0, 2, 1, 4)  # page_head: [2, H, P, L, D]

    def payload(self, buffer: torch.Tensor) -> torch.Tensor:
        """A record payload's bytes as ``[layers, 2, page, heads, head_dim]`` elements."""
        return buffer.view(self.dtype).view(self.layers, 2, *self.layout.shape)

    def read(self, index: int, out: torch.Tensor) -> None:
        """Copy the page at host index ``index`` into ``out`` (``payload`` view)."""
        out.copy_(self._page(index))

    def write(self, index: int, src: torch.Tensor) -> None:
        """Copy ``src`` (``payload`` view) into the page at host index ``index``."""
        self._page(index).copy_(src)

    def _flat_order(self, canonical: torch.Tensor) -> torch.Tensor:
        """``[L, 2, P, H, D]`` in the element order of the layout's flat page."""
        if self.layout_name == "page_first":
            return canonical.permute(1, 2, 0, 3, 4)  # [2, P, L, H, D]
        if self.layout_name in ("layer_first", "page_first_direct"):
            return canonical.permute(1, 0, 2, 3, 4)  # [2, L, P, H, D]
        return canonical.permute(1, 3, 2, 0, 4)  # page_head: [2, H, P, L, D]

    def to_flat(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """A payload (``payload`` view) as the flat page ``out`` SGLang's older interface
        fills (``get_dummy_flat_data_page``)."""
        order = self._flat_order(src)
        out.view(order.shape).copy_(order)

    def from_flat(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """A flat page (``get_data_page(index)``) into a payload (``payload`` view)."""
        order = self._flat_order(out)
        order.copy_(flat.reshape(order.shape))
