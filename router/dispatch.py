"""Dispatch policies over the router's own view of each actor (no Ray, no I/O).

Prefill: the actor holding the longest cached prefix of the prompt, then the
fewest queued prompt tokens. Decode: admission first (free KV blocks >= the
blocks prompt + max_tokens can fill), then the most free blocks. The router
keeps these views itself: it reserves decode blocks when it dispatches and
releases them when the request ends, and remembers which prompt blocks each
prefill actor has computed (an LRU bounded by that actor's pool).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class PrefillView:
    actor_id: str
    handle: Any
    kv_blocks_total: int
    queued_tokens: int = 0
    healthy: bool = True
    draining: bool = False
    incarnation: str = ""
    prefix: OrderedDict = field(default_factory=OrderedDict)   # block hash -> None, LRU order

    def cached_blocks(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefix:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.prefix[h] = None
            self.prefix.move_to_end(h)
        while len(self.prefix) > self.kv_blocks_total:
            self.prefix.popitem(last=False)


@dataclass(eq=False)
class DecodeView:
    actor_id: str
    handle: Any
    endpoint: str                      # its KV receiver
    kv_blocks_total: int
    stream_endpoint: str = ""          # its token stream (gRPC)
    reserved_blocks: int = 0
    running: int = 0
    healthy: bool = True
    draining: bool = False
    incarnation: str = ""

    @property
    def free_blocks(self) -> int:
        return self.kv_blocks_total - self.reserved_blocks


def pick_prefill(views: list[PrefillView], hashes: list[bytes],
                 exclude: set[str] = frozenset()) -> tuple[PrefillView | None, int]:
    """(actor, cached blocks): longest cached prefix, then fewest queued prompt tokens."""
    best, best_key = None, None
    for v in views:
        if not v.healthy or v.actor_id in exclude:
            continue
        cached = v.cached_blocks(hashes)
        key = (-cached, v.queued_tokens)
        if best_key is None or key < best_key:
            best, best_key = v, key
    return best, (-best_key[0] if best_key else 0)


def pick_decode(views: list[DecodeView], need_blocks: int, exclude: set[str] = frozenset()) -> DecodeView | None:
    """An actor with room for `need_blocks` (most free first), or None."""
    fits = [v for v in views if v.healthy and not v.draining and v.actor_id not in exclude
            and v.free_blocks >= need_blocks]
    return max(fits, key=lambda v: v.free_blocks) if fits else None


class AdmissionQueue:
    """Requests wait here (bounded) until a decode actor can hold their KV."""

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
        async with self._changed:
            self._changed.notify_all()
