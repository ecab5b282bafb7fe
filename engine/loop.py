"""A background thread that owns an engine: commands go in through an inbox, steps run in a loop.

Workers never touch the engine from other threads; they post closures with
`call` and the loop runs them between steps.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(f"pdserve.{__name__}")


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
        import asyncio
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(setter, value) -> None:
            if not fut.done():
                setter(value)

        def run() -> None:
            try:
                result = fn()
            except Exception as e:       # report to the caller, never kill the loop
                loop.call_soon_threadsafe(settle, fut.set_exception, e)
                return
            loop.call_soon_threadsafe(settle, fut.set_result, result)
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
            except Exception as e:      # a bug must not silently kill the worker: log and keep serving
                log.exception("engine loop error: %s", e)
                self.error = e
                wait_s = 0.05
