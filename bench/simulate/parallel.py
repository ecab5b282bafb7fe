"""A sweep's simulated runs side by side.

Each run of a sweep is independent — its own virtual clock, cluster, workload copy and seed — so
`pdserve simulate --jobs N` runs N at a time in worker processes. Results come
back in the order they were asked for and are the same as one at a time: a run's events depend only on
its inputs (bench/simulate/clock.py). Inside `jobs(n)`, `map_runs` spreads its calls over the workers;
outside it (and at one job) it calls them here, one after the other.

Workers fork from a fresh server process that has imported the simulator once (`forkserver`): they start
in milliseconds, and none inherits the threads of the process that asks (a Ray client's, a test
runner's), which a plain fork could catch holding a lock. Each pins torch to one thread (a run uses
no parallel kernels). A worker that dies (out of memory) fails the sweep with `WorkerLost`.

The workers end with the process that asked for them, however it ends. A worker watches that process's
sentinel (a pipe that closes when it exits, even by SIGKILL) and exits at once; on Linux it also asks for
SIGTERM when its own parent, the fork server, dies. The fork server and the resource tracker exit once
the asking process and every worker are gone. Inside `jobs`, a SIGTERM to the asking process (where it
has no handler of its own) stops the workers as a failed block does, then ends the process by that
SIGTERM.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_jobs = 1
_pool: ProcessPoolExecutor | None = None
PR_SET_PDEATHSIG = 1          # <linux/prctl.h>


class WorkerLost(RuntimeError):
    """A worker process died in the middle of a run."""


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Terminated(BaseException):
    """SIGTERM reached the process inside `jobs` (a BaseException: nothing on the way catches it)."""


def _start_worker() -> None:
    import torch
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the command's: it stops the workers
    _end_with_parent()


def _end_with_parent() -> None:
    """This worker exits when the process that asked for it does, or when the fork server (its parent) dies:
    re-parented, it would run its simulation to the end at full load for no one."""
    if sys.platform.startswith("linux"):
        try:                                           # SIGTERM when the fork server dies
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent = multiprocessing.parent_process()          # the asking process: its sentinel closes when it exits
    sentinel = None if parent is None else parent.sentinel
    if sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="simulate-parent-watch", daemon=True).start()


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


@contextlib.contextmanager
def jobs(n: int) -> Iterator[None]:
    """`map_runs` runs up to `n` calls at a time inside the block; its workers end with it (at once when the
    block fails, with the runs they were on, or when the process gets SIGTERM: then the process ends by it
    once they are stopped)."""
    global _jobs, _pool
    before, _jobs = _jobs, n
    on_term = _catch_sigterm() if n > 1 else None
    failed, terminated = True, False
    try:
        yield
        failed = False
    except _Terminated:
        terminated = True
        raise
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)     # a second SIGTERM ends the process as it would have
        pool, _pool, _jobs = _pool, None, before
        if pool is not None:
            if failed:               # (no public call stops running workers before Python 3.14)
                for process in list(getattr(pool, "_processes", {}).values()):
                    process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
        if terminated:
            os.kill(os.getpid(), signal.SIGTERM)       # the default action now: the process ends as signalled
            raise SystemExit(128 + signal.SIGTERM)     # (in case the signal waits for another thread)


def _catch_sigterm():
    """Install `_raise_terminated` for SIGTERM and return the handler it replaces, where SIGTERM would end
    the process unhandled and this is the main thread (where signal handlers run); None elsewhere."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def map_runs(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """[fn(item) for item in items], up to the `jobs` in force at a time. `fn` and the items must pickle."""
    global _pool
    if _jobs <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    if _pool is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["bench.simulate.cli"])
        _pool = ProcessPoolExecutor(_jobs, mp_context=context, initializer=_start_worker)
    try:
        return list(_pool.map(fn, items))
    except BrokenProcessPool:
        raise WorkerLost("a simulation worker process died (out of memory?); run fewer at once with a lower "
                         "--jobs") from None
