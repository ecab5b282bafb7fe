"""The offload queue: blocks evicted from the paged cache, on their way down to the tiers.

The paged cache's eviction (BlockManager.allocate, under its lock) hands each evicted full block here
*before* the block is given to its new owner: `offer` takes a copy of the block's rows at once (on the
cache's device: a device-to-device copy on CUDA, a memcpy on CPU), so nothing written into the block
afterwards can reach the copy. One thread then moves each copy to host memory and writes it down the
tiers. The queue has a bound: when it is full the block is dropped and counted, never waited for, so a
step never waits on a tier.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class OffloadQueue:
    """A bounded queue of (chained hash, block copy) and the thread that stores them."""

    def __init__(self, store: Callable[[bytes, torch.Tensor], None], max_blocks: int):
        assert max_blocks > 0
        self.max_blocks = max_blocks
        self.num_dropped = 0         # blocks not offloaded because the queue was full
        self._store = store
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_blocks)
        self._idle = threading.Condition()
        self._num_busy = 0           # queued or being stored
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    def offer(self, block_hash: bytes, rows: torch.Tensor) -> bool:
        """Queue a copy of `rows` (a block of the paged cache, about to be reused); False (dropped, counted)
        when the queue is full."""
        if self._queue.full():
            self.num_dropped += 1
            return False
        with self._idle:
            self._num_busy += 1
        try:
            self._queue.put_nowait((block_hash, rows.clone()))
        except queue.Full:
            with self._idle:
                self._num_busy -= 1
            self.num_dropped += 1
            return False
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is stored; False on timeout (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_busy == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once what is queued is stored (waits at most `timeout` for room to say so)."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._store(*item)
            except Exception as e:       # a tier bug must not stop offloading for good
                log.exception("KV offload failed: %s", e)
            finally:
                with self._idle:
                    self._num_busy -= 1
                    self._idle.notify_all()
