"""A background thread that owns an engine: commands go in through an inbox, steps run in a loop.

Workers never touch the engine from other threads; they post closures with
`call` and the loop runs them between steps.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from engine.parallel.group import RankGroupError

T = TypeVar("T")

log = logging.getLogger(f"pdserve.{__name__}")
EXIT_RANK_LOST = 70        # the process's exit status when a tensor-parallel peer is lost


def on_event_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[T], object]) -> Callable[[T], None]:
    """The thread → asyncio bridge: a callback that any thread may call; `fn` then runs on `loop`."""
    return lambda value: loop.call_soon_threadsafe(fn, value)


class EngineLoop:
    def __init__(self, name: str, step: Callable[[], float]):
        """step() runs one iteration and returns how long the loop may sleep before the next
        (0 while the engine has work; a command posted with `call` always wakes it)."""
        self._step = step
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before the next step."""
        self._inbox.put(fn)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    async def run_async(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the loop thread between steps; await its result (or exception) here."""
        fut = asyncio.get_running_loop().create_future()

        def settle(outcome: tuple[bool, object]) -> None:
            ok, value = outcome
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
        reply = on_event_loop(fut.get_loop(), settle)

        def run() -> None:
            try:
                reply((True, fn()))
            except Exception as e:       # report to the caller, never kill the loop
                reply((False, e))
        self.call(run)
        return await fut

    def wake(self) -> None:
        self._inbox.put(lambda: None)

    def run_once(self, wait_s: float = 0.0) -> float:
        """Drain the inbox (waiting up to `wait_s` for the first command), then step once."""
        try:
            fn = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
            while True:
                fn()
                fn = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return self._step()

    def _run(self) -> None:
        wait_s = 0.0
        while not self._stop.is_set():
            try:
                wait_s = self.run_once(wait_s)
            except RankGroupError as e:   # a tensor-parallel rank is gone: the actor cannot step again
                log.critical("engine loop: %s; ending the process (its requests are retried or migrated)", e)
                os._exit(EXIT_RANK_LOST)
            except Exception as e:      # a bug must not silently kill the worker: log and keep serving
                log.exception("engine loop error: %s", e)
                self.error = e
                wait_s = 0.05
