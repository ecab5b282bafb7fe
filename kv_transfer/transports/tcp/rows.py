"""A CPU cache's (layer, block) cells as byte ranges: what the tcp transport sends from and receives into.

In ``kv_cache [L, NB, 2, H, B, D]`` (contiguous) the cell ``kv_cache[l, b]`` is one contiguous run of
``cell_nbytes`` bytes at ``(l * NB + b) * cell_nbytes``. A chunk's payload under codec ``none`` is its
cells in (layer, block) order, so the socket can gather them on send and scatter into the destination
cells on receive; cells that lie side by side (consecutive block ids, whole layers) merge into one run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash


def cache_bytes(kv_cache: torch.Tensor) -> memoryview | None:
    """The whole cache as one writable byte view; None when its rows cannot be addressed (device, strided)."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    return memoryview(kv_cache.view(-1).view(torch.uint8).numpy())


def cell_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one (layer, block) cell: K and V of every head."""
    return kv_cache[0, 0].numel() * kv_cache.element_size()


def cell_runs(num_blocks: int, cell_bytes: int, layers: tuple[int, int],
              block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of ``kv_cache[l0:l1, block_ids]`` in payload order, adjacent cells merged.

    ``num_blocks``: the cache's NB; ``block_ids``: this chunk's blocks, in order.
    """
    runs: list[tuple[int, int]] = []
    for layer in range(*layers):
        base = layer * num_blocks
        for block_id in block_ids:
            start = (base + block_id) * cell_bytes
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + cell_bytes)
            else:
                runs.append((start, start + cell_bytes))
    return runs


def views(buffer: memoryview, runs: list[tuple[int, int]]) -> list[memoryview]:
    return [buffer[start:end] for start, end in runs]


def checksum_of(buffers: Sequence) -> int:
    """xxh3-64 of the buffers' concatenation (what ``wire.checksum`` gives the joined bytes), without joining."""
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return state.intdigest()
