"""A head view: KV heads [h0, h1) of a rank's paged cache, as a head copy of a resharding reads and writes them.

For a cache in the model dtype, ``kv_cache: [L, NB, 2, H, B, D]``, the head view is the strided tensor
``kv_cache[:, :, :, h0:h1]``. A quantized cache (``kv_cache.dtype`` fp8 / int8: engine/kv_cache/kv_format.py)
stores each (layer, block) as one cell of bytes,

    cell = data [2, H, B, D] (fp8 / int8)  ++  scales [2, H, S] (float32; S = 1 for fp8, B for int8)

so the heads' bytes are two slices of every cell, and its head view is `QuantizedHeads`: a view of the heads'
data and a view of their scales. Either way the head view's cell, read in order (K rows, then V rows; for a
quantized cache their data, then their scales), is byte for byte the cell of a cache that holds only those
heads: a head copy is an ordinary transfer between two caches of the copy's layout
(`kv_transfer.resharded.head_layout`), scales included, with no encode and no decode.

What a transport asks of a head view: ``shape`` (its layout's cache shape), ``dtype``, ``device``,
``is_contiguous()`` (never, for a `QuantizedHeads`); the stored codecs gather and scatter it part by part
(`cell_parts`), and transports that move bytes in place see its cells as byte runs of the cache's memory
(`kv_transfer.transports.tcp.rows.CellRuns`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.layout import KVLayout


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedHeads:
    """KV heads of a quantized cache ``[L, NB, cell bytes]`` uint8: two uint8 views of it."""

    data: torch.Tensor      # [L, NB, 2, h, B * D]: the heads' fp8 / int8 values
    scales: torch.Tensor    # [L, NB, 2, h, 4 * S]: their float32 scales, as bytes

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scales

    @property
    def shape(self) -> torch.Size:
        """[L, NB, cell bytes of an h-head cache]"""
        num_layers, num_blocks = self.data.shape[:2]
        return torch.Size((num_layers, num_blocks, self.data[0, 0].numel() + self.scales[0, 0].numel()))

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def dim(self) -> int:
        return 3

    def is_contiguous(self) -> bool:
        return False


def head_view(kv_cache: torch.Tensor, heads: range, layout: KVLayout) -> torch.Tensor | QuantizedHeads:
    """The KV heads `heads` (positions in this cache) of `kv_cache`, as views.

    `layout`: the layout of this cache or of any head range of it (only its storage is read: the model
    dtype or fp8 / int8, block size and head dim)."""
    if not layout.quantized:
        if kv_cache.dim() != 6 or not 0 <= heads.start < heads.stop <= kv_cache.shape[3]:
            raise ValueError(f"heads [{heads.start}, {heads.stop}) of a cache {tuple(kv_cache.shape)}")
        return kv_cache[:, :, :, heads.start:heads.stop]
    head_bytes = layout.cell_nbytes // layout.num_kv_heads         # one head's K and V data and scales
    value_bytes = layout.block_size * layout.head_dim               # one head's K (or V) data
    scale_bytes = head_bytes // 2 - value_bytes                     # one head's K (or V) scales
    num_heads = kv_cache.shape[-1] // head_bytes if kv_cache.dim() == 3 else 0
    if kv_cache.dtype != torch.uint8 or num_heads * head_bytes != kv_cache.shape[-1] or \
            not 0 <= heads.start < heads.stop <= num_heads:
        raise ValueError(f"heads [{heads.start}, {heads.stop}) of a kv_cache.dtype {layout.cache_dtype} cache "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype} (cells of {head_bytes}-byte heads)")
    split = 2 * num_heads * value_bytes
    data = kv_cache[:, :, :split].unflatten(2, (2, num_heads, value_bytes))
    scales = kv_cache[:, :, split:].unflatten(2, (2, num_heads, scale_bytes))
    return QuantizedHeads(data[:, :, :, heads.start:heads.stop], scales[:, :, :, heads.start:heads.stop])


def cell_parts(kv_cache: torch.Tensor | QuantizedHeads) -> tuple[torch.Tensor, ...]:
    """The tensors whose (layer, block) cells, one after the other, make a cell of `kv_cache` in payload order:
    the cache (or head view) itself, or a quantized head view's data and scales."""
    return kv_cache.parts if isinstance(kv_cache, QuantizedHeads) else (kv_cache,)
