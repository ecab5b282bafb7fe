"""The suite's one way to wait: for a condition, never for a fixed time (importable from every test folder).

    wait_until(lambda: server.ready)            # sync: poll until true, fail the test after `timeout`
    await until(lambda: assert_nothing_held(c))  # async; a predicate may also assert (a failed assert = not yet)
    await settle()                               # let every task that is ready run (no wall-clock wait):
                                                 # before checking that something did NOT happen
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.005


def _holds(predicate: Callable[[], object]) -> bool:
    try:
        result = predicate()
    except AssertionError:
        return False
    return result is None or bool(result)


def _fail(predicate: Callable[[], object], timeout: float) -> None:
    predicate()                    # an asserting predicate raises its own message
    raise AssertionError(f"condition not met within {timeout:.1f}s")


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds (true, or returns None without raising AssertionError)."""
    end = time.monotonic() + timeout
    while not _holds(predicate):
        if time.monotonic() > end:
            _fail(predicate, timeout)
        time.sleep(POLL_S)


async def until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """`wait_until` inside an event loop: other tasks run while it polls."""
    end = time.monotonic() + timeout
    while not _holds(predicate):
        if time.monotonic() > end:
            _fail(predicate, timeout)
        await asyncio.sleep(POLL_S)


async def settle(rounds: int = 50) -> None:
    """Give every ready task ``rounds`` turns of the loop; no time passes on purpose."""
    for _ in range(rounds):
        await asyncio.sleep(0)
