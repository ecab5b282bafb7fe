"""Admission: requests wait here, first come first served, until a decode actor can hold their KV.

The queue is bounded (`max_waiting`: more are refused at once) and so is every
wait (the caller's timeout: the client's deadline or `routing.max_queue_wait_s`).
Only the head of the queue may take room, so a large request is never starved
by smaller ones arriving after it; a newcomer takes room directly only when
nobody waits. `ready()` (optional) adds a condition of the caller's, e.g. room
in the prefill pool's backlog.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping

from router.placement.policies import pick_decode
from router.pools import DecodeView


class AdmissionQueue:
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._waiters: deque[asyncio.Event] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, views: list[DecodeView], need_blocks: int, timeout: float | None,
                      exclude: set[str] = frozenset(), ready: Callable[[], bool] = lambda: True,
                      first: bool = False, cached: Callable[[], Mapping[str, int]] = dict, num_prompt_blocks: int = 0,
                      policy: str = "kv_aware") -> DecodeView | None:
        """Reserve `need_blocks` on a decode actor; None if the queue is full or time ran out.
        `first`: a request already admitted once (migrating) goes ahead of the queue. `cached()`: actor id
        → the prompt's cached blocks there, asked when room is taken; `policy`: a key of
        `router.placement.policies.DECODE_POLICIES`."""
        def take() -> DecodeView | None:
            view = pick_decode(views, need_blocks, exclude, cached(), num_prompt_blocks, policy) if ready() else None
            if view is not None:
                view.reserved_blocks += need_blocks
                view.running += 1
            return view

        if first or not self._waiters:
            view = take()
            if view is not None:
                return view
        if not first and len(self._waiters) >= self.max_waiting:
            return None
        turn = asyncio.Event()
        self._waiters.appendleft(turn) if first else self._waiters.append(turn)

        async def wait_for_room() -> DecodeView:
            while True:
                if self._waiters[0] is turn:
                    view = take()
                    if view is not None:
                        return view
                turn.clear()
                await turn.wait()
        try:
            return await asyncio.wait_for(wait_for_room(), timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiters.remove(turn)
            self._wake_head()

    async def release(self, view: DecodeView, need_blocks: int) -> None:
        view.reserved_blocks -= need_blocks
        view.running -= 1
        await self.notify()

    async def notify(self) -> None:
        """Something changed (a reservation released, a pool changed, a backlog drained): the head
        of the queue checks again."""
        self._wake_head()

    def _wake_head(self) -> None:
        if self._waiters:
            self._waiters[0].set()
