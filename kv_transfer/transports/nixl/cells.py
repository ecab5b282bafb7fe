"""A paged cache's (layer, block) cells as NIXL descriptors, and checksums over them.

In ``kv_cache [L, NB, 2, H, B, D]`` (contiguous) the cell ``kv_cache[l, b]`` is one run of ``cell_bytes``
bytes at ``base + (l * NB + b) * cell_bytes``, on any device. A head view of a cache (a head copy of a
tensor-parallel resharding: kv_transfer/head_view.py) moves a few runs of each cell instead, the same for every
cell (K's and V's rows of its heads; for a quantized cache their data and their scales): the end registers its
whole cache and describes the runs (`CacheShape.runs`, offsets from the region's base for cell (0, 0)). A
chunk's cells (their runs) on the two ends pair up in payload order (layer-major, blocks in the transfer's
order, runs in order); where both ends' next runs follow on, the pair grows instead of adding a descriptor, so
contiguous block runs of whole cells move as one descriptor per layer. A chunk's checksum is the one its
codec-none payload would carry: xxh3-64 over its cells in payload order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer.head_view import cell_parts
from kv_transfer.transports.nixl.agent import Region
from kv_transfer.transports.tcp.rows import CellRuns, cache_bytes, checksum_of, views
from kv_transfer.wire import host_checksum

MAX_RUNS = 16       # runs per cell a peer may describe (a quantized head view has 4)


@dataclass(frozen=True, slots=True)
class CacheShape:
    """Where one end's cache lives and which bytes of each cell it moves."""

    region: Region
    num_blocks: int  # NB
    cell_bytes: int  # from one cell to the next
    runs: tuple[tuple[int, int], ...]   # (offset from the region's base, nbytes) of cell (0, 0), payload order

    @classmethod
    def of(cls, region: Region, cells: CellRuns) -> CacheShape:
        """`region`: the registration of ``cells.memory``."""
        return cls(region, cells.num_blocks, cells.cell_bytes, cells.runs)

    @property
    def nbytes(self) -> int:
        """Bytes a cell moves (two ends pair up when theirs are equal)."""
        return sum(length for _, length in self.runs)

    def describe(self) -> dict:
        return {**self.region.describe(), "num_blocks": self.num_blocks, "cell_bytes": self.cell_bytes,
                "runs": [list(run) for run in self.runs]}

    @classmethod
    def parse(cls, value: object) -> CacheShape:
        keys = ("num_blocks", "cell_bytes", "runs")
        region = Region.parse({k: v for k, v in value.items() if k not in keys} if isinstance(value, dict) else value)
        num_blocks, cell_bytes, runs = value.get("num_blocks"), value.get("cell_bytes"), value.get("runs")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (num_blocks, cell_bytes)) \
                or not isinstance(runs, list) or not 0 < len(runs) <= MAX_RUNS \
                or not all(isinstance(run, list) and len(run) == 2 and
                           all(isinstance(v, int) and not isinstance(v, bool) for v in run) for run in runs):
            raise ValueError(f"malformed cache description {value!r}")
        runs = tuple((offset, length) for offset, length in runs)
        last = (num_blocks - 1) * cell_bytes      # every run of every block of layer 0 inside the region ...
        if any(offset < 0 or length <= 0 or offset + length + last > region.nbytes for offset, length in runs):
            raise ValueError(f"malformed cache description {value!r}")
        return cls(region, num_blocks, cell_bytes, runs)

    def addresses(self, layers: tuple[int, int], block_ids: Sequence[int], offsets: Sequence[int]) -> np.ndarray:
        """int64 [l1 - l0, n, len(offsets)]: the address of each of ``offsets`` (into cell (0, 0)'s position) in
        every cell of ``kv[l0:l1, block_ids]``."""
        layer = np.arange(layers[0], layers[1], dtype=np.int64)[:, None, None]
        blocks = np.asarray(block_ids, dtype=np.int64)[None, :, None]
        at = np.asarray(offsets, dtype=np.int64)[None, None, :]
        return self.region.base + at + (layer * self.num_blocks + blocks) * self.cell_bytes


def common_runs(one: Sequence[tuple[int, int]], other: Sequence[tuple[int, int]]) -> tuple[list, list]:
    """Two ends' runs of a cell (the same bytes in payload order, split differently: a whole cell on one end, the
    K and V runs of a head view on the other) cut where either end's runs break: pairs of equal lengths."""
    pieces: tuple[list, list] = ([], [])
    i = j = 0
    (a, a_left), (b, b_left) = one[0], other[0]
    while True:
        n = min(a_left, b_left)
        pieces[0].append((a, n))
        pieces[1].append((b, n))
        a, a_left, b, b_left = a + n, a_left - n, b + n, b_left - n
        if not a_left:
            i += 1
            if i == len(one):
                return pieces
            a, a_left = one[i]
        if not b_left:
            j += 1
            b, b_left = other[j]


def paired_descriptors(local: CacheShape, local_ids: Sequence[int], remote: CacheShape, remote_ids: Sequence[int],
                       layers: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [N, 3] (address, bytes, device id) on each end for the cells ``kv[l0:l1, ids]``, merged where both
    ends continue. The two ends' cells must move the same bytes (equal layouts), their runs may split them
    differently."""
    mine, theirs = common_runs(local.runs, remote.runs)
    here = local.addresses(layers, local_ids, [offset for offset, _ in mine]).ravel()
    there = remote.addresses(layers, remote_ids, [offset for offset, _ in theirs]).ravel()
    sizes = np.resize(np.asarray([length for _, length in mine], dtype=np.int64), here.size)
    breaks = np.flatnonzero((here[:-1] + sizes[:-1] != here[1:]) | (there[:-1] + sizes[:-1] != there[1:])) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.add.reduceat(sizes, starts) if here.size else sizes
    return _rows(here[starts], lengths, local.region.device_id), _rows(there[starts], lengths, remote.region.device_id)


def span_descriptor(region: Region, offset: int, nbytes: int) -> np.ndarray:
    """uint64 [1, 3]: ``nbytes`` at ``offset`` into ``region``."""
    return _rows(np.array([region.base + offset], dtype=np.int64), np.array([nbytes], dtype=np.int64),
                 region.device_id)


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addresses, lengths, device_id
    return rows


def cells_checksum(kv_cache, layers: tuple[int, int], block_ids: Sequence[int]) -> int:
    """xxh3-64 of ``kv_cache[l0:l1, block_ids]`` (a cache or a head view) in payload order (a device cache is
    hashed on a host copy)."""
    addressed = cache_bytes(kv_cache)
    if addressed is not None:
        rows, cells = addressed
        return checksum_of(views(rows, cells.ranges(layers, block_ids)))
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    parts = [torch.index_select(part[layers[0] : layers[1]], 1, index) for part in cell_parts(kv_cache)]
    cells = torch.cat([part.reshape(*part.shape[:2], -1).view(torch.uint8) for part in parts], dim=2)
    return host_checksum(cells.contiguous().view(-1))
