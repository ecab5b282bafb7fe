"""The registered staging area of one end: encoded (fp8 / int8) chunks are written into it on the sender and
read into it on the receiver, so a codec's payload moves one-sided like the cache's cells do.

    arena = StagingArena(nbytes, device)       # register arena.buffer with the agent once
    offset = arena.acquire(nbytes, deadline)   # a slot (first fit), waiting for room until the deadline
    arena.view(offset, nbytes)                 # uint8 tensor over the slot
    arena.release(offset)

Slots start on ALIGN-byte boundaries (a payload's float32 scales are viewed in place). A slot larger than
the whole arena is refused at once.
"""

from __future__ import annotations

import bisect
import threading
import time

import torch

ALIGN = 64
DEFAULT_STAGING_BYTES = 64 << 20


class StagingFull(RuntimeError):
    """No room for a slot before the deadline (or never: larger than the arena)."""


class StagingArena:
    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.nbytes = nbytes
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # zeros: pages faulted in now
        self._free: list[tuple[int, int]] = [(0, nbytes)]   # sorted (offset, size) holes
        self._used: dict[int, int] = {}                     # offset -> size
        self._cond = threading.Condition()

    @property
    def num_used(self) -> int:
        with self._cond:
            return len(self._used)

    def acquire(self, nbytes: int, deadline: float) -> int:
        """The offset of a free slot of ``nbytes``; StagingFull when none frees up by ``deadline`` (monotonic)."""
        size = -(-max(1, nbytes) // ALIGN) * ALIGN
        if size > self.nbytes:
            raise StagingFull(f"a {nbytes}-byte chunk does not fit the {self.nbytes}-byte nixl staging area "
                              f"(kv_transfer.nixl.staging_bytes)")
        with self._cond:
            while True:
                for index, (offset, hole) in enumerate(self._free):
                    if hole >= size:
                        if hole == size:
                            del self._free[index]
                        else:
                            self._free[index] = (offset + size, hole - size)
                        self._used[offset] = size
                        return offset
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingFull(f"no room for a {nbytes}-byte chunk in the nixl staging area before the "
                                      f"deadline ({len(self._used)} chunks in flight)")
                self._cond.wait(left)

    def release(self, offset: int) -> None:
        with self._cond:
            size = self._used.pop(offset)
            index = bisect.bisect(self._free, (offset, size))
            self._free.insert(index, (offset, size))
            if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:   # merge the next hole
                self._free[index] = (offset, size + self._free.pop(index + 1)[1])
            if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:  # and the previous
                previous = self._free.pop(index - 1)
                self._free[index - 1] = (previous[0], previous[1] + self._free[index - 1][1])
            self._cond.notify_all()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]
