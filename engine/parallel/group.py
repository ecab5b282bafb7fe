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
import random
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RankGroupError(RuntimeError):
    """A collective of the group failed or timed out: a rank died or stalled; the actor is broken."""


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
SAFE_LOW = 20000       # below: Ray's worker ports (10002-19999 by default) and well-known services


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server another process binds a little later (rank 0's store).

    Drawn at random below the kernel's ephemeral range where the host has room there: outgoing connections and
    port-0 binds take their ports from that range, so in the seconds before its owner binds it, a port drawn
    here is not handed to another socket (one the kernel picks could be, and its owner's bind then fails with
    "address already in use"). Falls back to a port the kernel picks when no such room is free.
    """
    low = _ephemeral_low()
    draws = random.SystemRandom()
    for _ in range(64 if low - SAFE_LOW >= 1024 else 0):
        port = draws.randrange(SAFE_LOW, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux); 49152 (IANA's) where it cannot be read."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


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
