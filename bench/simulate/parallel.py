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
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_jobs = 1
_pool: ProcessPoolExecutor | None = None


class WorkerLost(RuntimeError):
    """A worker process died in the middle of a run."""


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_worker() -> None:
    import torch
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the command's: it stops the workers


@contextlib.contextmanager
def jobs(n: int) -> Iterator[None]:
    """`map_runs` runs up to `n` calls at a time inside the block; its workers end with it (at once when the
    block fails, with the runs they were on)."""
    global _jobs, _pool
    before, _jobs = _jobs, n
    failed = True
    try:
        yield
        failed = False
    finally:
        pool, _pool, _jobs = _pool, None, before
        if pool is not None:
            if failed:               # (no public call stops running workers before Python 3.14)
                for process in list(getattr(pool, "_processes", {}).values()):
                    process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)


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
