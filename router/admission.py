"""Admission: requests wait here (bounded) until a decode actor can hold their KV."""
from __future__ import annotations

import asyncio

from router.dispatch import pick_decode
from router.pools import DecodeView


class AdmissionQueue:
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self._changed = asyncio.Condition()

    async def acquire(self, views: list[DecodeView], need_blocks: int, timeout: float | None,
                      exclude: set[str] = frozenset()) -> DecodeView | None:
        """Reserve `need_blocks` on a decode actor; None if the queue is full or time ran out."""
        view = pick_decode(views, need_blocks, exclude)
        if view is None:
            if self.num_waiting >= self.max_waiting:
                return None
            self.num_waiting += 1
            try:
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(
                        lambda: pick_decode(views, need_blocks, exclude) is not None), timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                self.num_waiting -= 1
            view = pick_decode(views, need_blocks, exclude)
            if view is None:
                return None
        view.reserved_blocks += need_blocks
        view.running += 1
        return view

    async def release(self, view: DecodeView, need_blocks: int) -> None:
        view.reserved_blocks -= need_blocks
        view.running -= 1
        await self.notify()

    async def notify(self) -> None:
        """Wake the waiters: a reservation was released or the pools changed."""
        async with self._changed:
            self._changed.notify_all()
