"""A paged cache's (layer, block) cells as NIXL descriptors, and checksums over them.

In ``kv_cache [L, NB, 2, H, B, D]`` (contiguous) the cell ``kv_cache[l, b]`` is one run of ``cell_nbytes``
bytes at ``base + (l * NB + b) * cell_nbytes``, on any device. A chunk's cells on the two ends pair up in
payload order (layer-major, blocks in the transfer's order); where both ends' next cells follow on, the
pair grows instead of adding a descriptor, so contiguous block runs move as one descriptor per layer.
A chunk's checksum is the one its codec-none payload would carry: xxh3-64 over its cells in payload order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer.transports.nixl.agent import Region
from kv_transfer.transports.tcp.rows import cache_bytes, cell_nbytes, cell_runs, checksum_of, views
from kv_transfer.wire import host_checksum


@dataclass(frozen=True, slots=True)
class CacheShape:
    """Where one end's cache lives and how its cells are laid out."""

    region: Region
    num_blocks: int  # NB
    cell_bytes: int

    @classmethod
    def of(cls, region: Region, kv_cache: torch.Tensor) -> CacheShape:
        return cls(region, kv_cache.shape[1], cell_nbytes(kv_cache))

    def describe(self) -> dict:
        return {**self.region.describe(), "num_blocks": self.num_blocks, "cell_bytes": self.cell_bytes}

    @classmethod
    def parse(cls, value: object) -> CacheShape:
        region = Region.parse({k: v for k, v in value.items() if k not in ("num_blocks", "cell_bytes")}
                              if isinstance(value, dict) else value)
        num_blocks, cell_bytes = value.get("num_blocks"), value.get("cell_bytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (num_blocks, cell_bytes)) \
                or num_blocks * cell_bytes > region.nbytes:
            raise ValueError(f"malformed cache description {value!r}")
        return cls(region, num_blocks, cell_bytes)

    def addresses(self, layers: tuple[int, int], block_ids: Sequence[int]) -> np.ndarray:
        """int64 [l1 - l0, n]: the address of every cell of ``kv[l0:l1, block_ids]``."""
        layer = np.arange(layers[0], layers[1], dtype=np.int64)[:, None]
        blocks = np.asarray(block_ids, dtype=np.int64)[None, :]
        return self.region.base + (layer * self.num_blocks + blocks) * self.cell_bytes


def paired_descriptors(local: CacheShape, local_ids: Sequence[int], remote: CacheShape, remote_ids: Sequence[int],
                       layers: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [N, 3] (address, bytes, device id) on each end for the cells ``kv[l0:l1, ids]``, merged where both
    ends continue. The two ends' cells must be the same size (equal layouts)."""
    cell = local.cell_bytes
    here = local.addresses(layers, local_ids).ravel()
    there = remote.addresses(layers, remote_ids).ravel()
    breaks = np.flatnonzero((np.diff(here) != cell) | (np.diff(there) != cell)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [here.size]))) * cell
    return _rows(here[starts], lengths, local.region.device_id), _rows(there[starts], lengths, remote.region.device_id)


def span_descriptor(region: Region, offset: int, nbytes: int) -> np.ndarray:
    """uint64 [1, 3]: ``nbytes`` at ``offset`` into ``region``."""
    return _rows(np.array([region.base + offset], dtype=np.int64), np.array([nbytes], dtype=np.int64),
                 region.device_id)


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addresses, lengths, device_id
    return rows


def cells_checksum(kv_cache: torch.Tensor, layers: tuple[int, int], block_ids: Sequence[int]) -> int:
    """xxh3-64 of ``kv_cache[l0:l1, block_ids]`` in payload order (a device cache is hashed on a host copy)."""
    rows = cache_bytes(kv_cache)
    if rows is not None:
        return checksum_of(views(rows, cell_runs(kv_cache.shape[1], cell_nbytes(kv_cache), layers, block_ids)))
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    cells = torch.index_select(kv_cache[layers[0] : layers[1]], 1, index)
    return host_checksum(cells.contiguous().view(-1).view(torch.uint8))
