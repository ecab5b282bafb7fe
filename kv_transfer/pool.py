"""The receiver's view of the decode actor's block pool.

The decode actor owns the allocator; the receiver only reserves blocks for an
incoming transfer and gives them back if the transfer fails, expires or is
cancelled. After DONE the blocks belong to the decode worker.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockAllocator(Protocol):
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Reserve ``num_blocks`` block ids (any order); None when not enough are free."""

    def free(self, block_ids: list[int]) -> None:
        """Return block ids to the pool."""


class SimpleBlockPool:
    """A thread-safe in-memory allocator for tests and warm-up.

    Hands out the lowest free ids first (so tests can assert exact ids) and
    asserts on double frees; ``num_used`` == 0 is the leak check.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_used(self) -> int:
        with self._lock:
            return len(self._used)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_ids(self) -> set[int]:
        with self._lock:
            return set(self._used)

    def can_allocate(self, num_blocks: int) -> bool:
        with self._lock:
            return len(self._free) >= num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        with self._lock:
            if num_blocks > len(self._free):
                return None
            self._free.sort()
            block_ids, self._free = self._free[:num_blocks], self._free[num_blocks:]
            self._used.update(block_ids)
            return block_ids

    def take(self, block_ids: list[int]) -> None:
        """Mark specific ids used (tests use it to force non-contiguous allocations)."""
        with self._lock:
            for block_id in block_ids:
                assert block_id not in self._used, f"block {block_id} already used"
                self._free.remove(block_id)
                self._used.add(block_id)

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            for block_id in block_ids:
                assert block_id in self._used, f"double free of block {block_id}"
                self._used.remove(block_id)
                self._free.append(block_id)


class LockedAllocator:
    """Wrap an allocator with a lock shared with its other user.

    The receiver calls ``allocate``/``free`` from transport threads; a decode
    worker whose block manager is not thread-safe passes its own lock here.
    """

    def __init__(self, allocator: BlockAllocator, lock: threading.Lock | threading.RLock | None = None) -> None:
        self.allocator = allocator
        self.lock = lock or threading.Lock()

    def allocate(self, num_blocks: int) -> list[int] | None:
        with self.lock:
            return self.allocator.allocate(num_blocks)

    def free(self, block_ids: list[int]) -> None:
        with self.lock:
            self.allocator.free(block_ids)
