"""The rank group of one tensor-parallel actor: a store, a process group and the all-reduce.

Rank 0 hosts a TCPStore at the group's address; every rank joins it and builds its own process group over
it (NCCL on CUDA, gloo on CPU over 127.0.0.1 or GLOO_SOCKET_IFNAME), never torch.distributed's default
group, so a process may also hold KV-transfer groups. Every wait names a timeout: a rank that dies makes the
others' next collective fail within `timeout` instead of hanging (gloo usually notices the closed
connection at once). A group of one rank is the no-op case: `all_reduce` returns its input.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RankGroupError(RuntimeError):
    """A collective of the group failed or timed out: a rank died or stalled; the actor is broken."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for rank 0's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankGroup:
    """Args:
        rank, size: this process's rank and the group's size.
        address: "host:port" of rank 0's store (every rank passes the same).
        device: the rank's device (NCCL when CUDA, gloo otherwise).
        timeout_s: the bound on joining and on every collective.
        backend: "auto" (as the device says), "nccl" or "gloo" (gloo on CUDA lets ranks share one device,
            which NCCL refuses: a diagnostic on a one-GPU machine).
    """

    def __init__(self, rank: int = 0, size: int = 1, address: str = "127.0.0.1:0",
                 device: torch.device | None = None, timeout_s: float = 60.0, backend: str = "auto"):
        self.rank, self.size = rank, size
        self.timeout = timedelta(seconds=timeout_s)
        self.store = self.group = None
        self.reduce_s = 0.0          # time spent in all-reduces (waiting for the slowest rank included)
        self.num_reduces = 0
        if size == 1:
            return
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or int(port) == 0:
            raise ValueError(f"tensor-parallel address must be host:port with a port, got {address!r}")
        self.store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=self.timeout,
                                   wait_for_workers=True)
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"tensor_parallel_backend must be auto, nccl or gloo; got {backend!r}")
        if backend == "auto":
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        self.backend = backend
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("tp", self.store), rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [_gloo_device(host)]
            options._timeout = self.timeout
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("tp", self.store), rank, size, options)
        log.info("tensor-parallel rank %d of %d joined (%s, store %s)", rank, size, self.backend, address)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; the input itself with one rank."""
        if self.group is None:
            if self.size > 1:
                raise RankGroupError(f"tensor-parallel rank {self.rank} of {self.size}: the group is closed")
            return x
        start = time.perf_counter()
        try:
            work = self.group.allreduce([x])
            if not work.wait(self.timeout):
                raise TimeoutError(f"all-reduce did not complete within {self.timeout.total_seconds():.0f} s")
        except Exception as exc:
            raise RankGroupError(f"tensor-parallel rank {self.rank} of {self.size}: all-reduce failed "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
        self.reduce_s += time.perf_counter() - start
        self.num_reduces += 1
        return x

    def close(self) -> None:
        """Drop the group (its peers' pending operations then fail); the store goes with rank 0."""
        if self.group is not None:
            try:
                self.group.abort()
            except Exception:        # already broken, or gloo without abort: dropping it closes it
                pass
        self.group = None


def _gloo_device(host: str):
    """Loopback ranks talk over 127.0.0.1; others over GLOO_SOCKET_IFNAME (or gloo's default)."""
    if host.startswith("127.") or host == "localhost":
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_default_device()
