"""A CPU cache's (layer, block) cells as byte ranges: what the tcp transport sends from and receives into.

In ``kv_cache [L, NB, 2, H, B, D]`` (contiguous) the cell ``kv_cache[l, b]`` is one contiguous run of
``cell_nbytes`` bytes at ``(l * NB + b) * cell_nbytes``. A chunk's payload under codec ``none`` is its
cells in (layer, block) order, so the socket can gather them on send and scatter into the destination
cells on receive; cells that lie side by side (consecutive block ids, whole layers) merge into one run.

A head view of a cache (kv_transfer/head_view.py) moves a few runs of each cell instead: K's and V's rows
of its heads (model dtype), or their data and their scales (fp8 / int8); `CellRuns` says where they lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from kv_transfer.head_view import cell_parts


@dataclass(frozen=True, slots=True, eq=False)
class CellRuns:
    """Where the cells of a cache, or of a head view of one, lie in the memory the cache was allocated in.

    Cell ``(l, b)`` moves the bytes ``runs`` shifted by ``(l * num_blocks + b) * cell_bytes``, in that order."""

    memory: torch.Tensor                 # uint8 [nbytes]: the cache's whole (contiguous) memory
    num_blocks: int                      # NB
    cell_bytes: int                      # from one cell of the cache to the next
    runs: tuple[tuple[int, int], ...]    # (offset into memory, nbytes) of cell (0, 0), payload order

    @property
    def nbytes(self) -> int:
        """Bytes one cell moves (a payload's cell)."""
        return sum(length for _, length in self.runs)

    @classmethod
    def of(cls, kv_cache) -> CellRuns | None:
        """None when the cells are not byte runs of one memory (a view other than a head view)."""
        runs: list[tuple[int, int]] = []
        stride = None
        for part in cell_parts(kv_cache):
            size, steps = part.element_size(), part.stride()
            if part.dim() < 3 or steps[0] != part.shape[1] * steps[1] or stride not in (None, steps[1] * size):
                return None
            stride, offset, cell = steps[1] * size, part.storage_offset() * size, part[0, 0]
            if cell.is_contiguous():
                runs.append((offset, cell.numel() * size))
            elif cell.dim() >= 2 and cell[0].is_contiguous():        # a head view: one run per K / V
                runs += [(offset + kv * steps[2] * size, cell[0].numel() * size) for kv in range(part.shape[2])]
            else:
                return None
        merged: list[tuple[int, int]] = []
        for start, length in runs:
            if merged and sum(merged[-1]) == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        memory = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(
            cell_parts(kv_cache)[0].untyped_storage())
        return cls(memory, kv_cache.shape[1], stride, tuple(merged))

    def ranges(self, layers: tuple[int, int], block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of memory holding ``kv[l0:l1, block_ids]`` in payload order, adjacent merged."""
        return cell_runs(self.num_blocks, self.cell_bytes, layers, block_ids, self.runs)


def cache_bytes(kv_cache) -> tuple[memoryview, CellRuns] | None:
    """A CPU cache's memory as one writable byte view, and where its cells lie; None when its cells cannot be
    addressed as bytes (device, strided other than a head view)."""
    if kv_cache.device.type != "cpu":
        return None
    cells = CellRuns.of(kv_cache)
    return None if cells is None else (memoryview(cells.memory.numpy()), cells)


def cell_runs(num_blocks: int, cell_bytes: int, layers: tuple[int, int], block_ids: Sequence[int],
              runs: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of ``kv_cache[l0:l1, block_ids]`` in payload order, adjacent ranges merged.

    ``num_blocks``: the cache's NB; ``block_ids``: this chunk's blocks, in order; ``runs``: (offset, nbytes) of
    the bytes each cell moves, relative to cell (0, 0) (default: the whole cell at 0).
    """
    runs = ((0, cell_bytes),) if runs is None else runs
    ranges: list[tuple[int, int]] = []
    for layer in range(*layers):
        base = layer * num_blocks
        for block_id in block_ids:
            shift = (base + block_id) * cell_bytes
            for offset, length in runs:
                start = shift + offset
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], start + length)
                else:
                    ranges.append((start, start + length))
    return ranges


def views(buffer: memoryview, runs: list[tuple[int, int]]) -> list[memoryview]:
    return [buffer[start:end] for start, end in runs]


def checksum_of(buffers: Sequence) -> int:
    """xxh3-64 of the buffers' concatenation (what ``wire.checksum`` gives the joined bytes), without joining."""
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return state.intdigest()
