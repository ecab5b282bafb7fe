"""A second process that runs tensor-parallel rank 1 of whatever engines a test builds as rank 0."""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing

import torch

from engine import Engine, EngineArgs
from engine.parallel.group import free_port

JOIN_S = 60          # the most a rank waits for its peer, here and in the engine's own timeout


def _follow(conn) -> None:
    """Rank 1: build each engine sent, follow rank 0 until it closes, say how it ended; None ends."""
    torch.set_num_threads(1)
    while (args := conn.recv()) is not None:
        try:
            Engine(args).follow()
            conn.send("closed")
        except Exception as exc:         # reported to the test, which asserts on it
            conn.send(f"{type(exc).__name__}: {exc}")


class Follower:
    """Rank 1 in a spawned process; `engine(args)` builds rank 0 here with rank 1 there."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_follow, args=(child,), daemon=True)
        self.process.start()

    def start(self, args: EngineArgs, size: int = 2) -> EngineArgs:
        """Start rank 1 of `args` at `size` there; returns rank 0's args."""
        args = dataclasses.replace(args, tensor_parallel=size, tensor_parallel_rank=1, tensor_parallel_timeout_s=JOIN_S,
                                   tensor_parallel_address=f"127.0.0.1:{free_port()}")
        self.conn.send(args)
        return dataclasses.replace(args, tensor_parallel_rank=0)

    def ended(self, timeout: float = JOIN_S) -> str:
        """How rank 1's last engine ended ("closed", or its error)."""
        assert self.conn.poll(timeout), "rank 1 did not end"
        return self.conn.recv()

    @contextlib.contextmanager
    def engine(self, args: EngineArgs):
        engine = Engine(self.start(args))
        try:
            yield engine
        finally:
            engine.close()
        assert self.ended() == "closed"

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
        self.process.join(JOIN_S)
        if self.process.is_alive():
            self.process.kill()
