"""The host tier: blocks in host memory, LRU, as the paged cache stores them (bit-exact)."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class HostTier:
    """Blocks (each `[num_layers, 2, num_kv_heads, block_size, head_dim]` as stored) keyed by chained hash.

    On a CUDA actor the blocks sit in pinned memory, so onboarding copies them to the device without a
    staging copy. Thread-safe.
    """

    kind = "host"

    def __init__(self, capacity_bytes: int, pin: bool = False):
        self.capacity_bytes = capacity_bytes
        self.pin = pin
        self.num_bytes = 0
        self.enabled = True
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()    # least recently used first
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def touch(self, block_hash: bytes) -> bool:
        """Mark the block most recently used; False if the tier lacks it."""
        with self._lock:
            if block_hash not in self._blocks:
                return False
            self._blocks.move_to_end(block_hash)
            return True

    def put(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Store a block (a host tensor this tier may keep); returns the blocks it pushed out, LRU first
        (the block itself when it alone exceeds the capacity)."""
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            return [(block_hash, block)]
        if self.pin and not block.is_pinned():
            block = block.pin_memory()
        evicted = []
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return []
            while self.num_bytes + size > self.capacity_bytes:
                old_hash, old = self._blocks.popitem(last=False)
                self.num_bytes -= old.numel() * old.element_size()
                evicted.append((old_hash, old))
            self._blocks[block_hash] = block
            self.num_bytes += size
        return evicted

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block (most recently used from now on), or None."""
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
            return block

