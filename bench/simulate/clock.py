"""A virtual clock for asyncio: the event loop jumps to the next timer instead of waiting for it.

`VirtualEventLoop` is asyncio's selector loop with two changes: `time()` reads a `VirtualClock`,
and its selector never blocks — when nothing is ready, the clock advances by the timeout the loop
asked to wait (to its next timer) and the loop goes on. `asyncio.sleep`, `wait_for`, `call_at`
and every timeout therefore run on simulated seconds, as fast as the CPU allows, and the order
of events is the order of their virtual times (ties: the order they were scheduled), so a run is
deterministic for its inputs.

The control plane also stamps `time.monotonic()` directly (deadlines, timelines, quarantines);
`virtual_time(clock)` points `time.monotonic` at the clock while a simulation runs, so that code
runs unchanged. Wall-clock `time.time()` (log records) and `time.perf_counter()` are untouched.

A simulated engine step runs at once and its time passes after it (the actor sleeps it). So that the
engine's own stamps fall where a device's would, the step's length is the clock's `ahead` from when
the step is priced (its forward pass) until the actor sleeps: `time.monotonic()` then reads the step's
end (the forward pass done, its tokens sampled), while the loop's own time (`loop.time()`, timers)
stays at its start.
"""
from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Coroutine, Iterator
from typing import TypeVar

T = TypeVar("T")

START_S = 1000.0      # the clock's first reading: never 0, which some code reads as "unset"


class SimulationStalled(RuntimeError):
    """Nothing is scheduled and nothing can wake the loop: the simulation would wait forever."""


class VirtualClock:
    def __init__(self, start_s: float = START_S):
        self.now = start_s
        self.ahead = 0.0          # the length of a simulated step being computed (module docstring)

    def monotonic(self) -> float:
        return self.now + self.ahead

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds


class VirtualSelector(selectors.SelectSelector):
    """Never waits: a wait becomes a jump of the virtual clock. Nothing in a simulation does I/O; a
    callback another thread posts (`call_soon_threadsafe`) is in the loop's ready queue already, and the
    self-pipe's wake-up byte it also writes is only for a loop that blocks, which this one never does."""

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None):
        if timeout is None:
            raise SimulationStalled("no timer is scheduled and no task can run")
        self.clock.advance(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock | None = None):
        self.clock = clock or VirtualClock()
        super().__init__(VirtualSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


@contextlib.contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    """`time.monotonic()` reads `clock` inside the block (restored after, also on error)."""
    real = time.monotonic
    time.monotonic = clock.monotonic
    try:
        yield
    finally:
        time.monotonic = real


def run_virtual(coro: Coroutine[object, object, T], clock: VirtualClock | None = None) -> T:
    """Run `coro` to completion on a fresh `VirtualEventLoop` under `virtual_time`."""
    loop = VirtualEventLoop(clock)
    with virtual_time(loop.clock):
        try:
            return loop.run_until_complete(coro)
        finally:
            try:
                _cancel_remaining(loop)
            finally:
                loop.close()


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
