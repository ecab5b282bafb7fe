"""Reused byte buffers for the transfer hot path.

Fresh multi-MiB tensors cost a page fault per 4 KiB on first touch — on
this kind of machine that alone caps a pass at ~6 GB/s, slower than the
codec's arithmetic. Encode and decode therefore borrow their temporaries
(``scratch``) and chunk payloads (``payloads``) from small bounded pools.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MAX_CACHED = 8  # sets / buffers kept per pool; more concurrent users just allocate


class Scratch:
    """Named temporaries for one encode or decode; grown on demand, never shrunk."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        key = (name, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes].view(dtype).view(shape)


class _ScratchPool:
    def __init__(self) -> None:
        self._free: list[Scratch] = []
        self._lock = threading.Lock()

    @contextmanager
    def lease(self) -> Iterator[Scratch]:
        with self._lock:
            scratch = self._free.pop() if self._free else Scratch()
        try:
            yield scratch
        finally:
            with self._lock:
                if len(self._free) < MAX_CACHED:
                    self._free.append(scratch)


class _PayloadPool:
    """uint8 payload buffers by (size, device); ``release`` when the bytes are on the wire."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            stack = self._free.get((nbytes, device))
            if stack:
                self._count -= 1
                return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._count >= MAX_CACHED:
                return
            self._free.setdefault((buffer.numel(), buffer.device), []).append(buffer)
            self._count += 1


scratch_pool = _ScratchPool()
payload_pool = _PayloadPool()


_MALLOC_TUNED = []


def tune_malloc() -> None:
    """Keep multi-MiB frames in glibc's heap instead of fresh mmap()s.

    gRPC and Python hand every message over as a new ``bytes``; above glibc's
    mmap threshold each is a fresh mapping, faulted in page by page and
    unmapped on free — that alone halved the sender's framing rate here.
    Raising the mmap and trim thresholds lets freed frames be reused. It is
    process-wide (and harmless for the engine: tensors over 64 MiB still get
    their own mappings); set PDSERVE_KV_MALLOPT=0 to leave malloc alone.
    """
    if _MALLOC_TUNED or os.environ.get("PDSERVE_KV_MALLOPT", "1") == "0":
        return
    _MALLOC_TUNED.append(True)
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 64 << 20)
        libc.mallopt(m_trim_threshold, 512 << 20)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass
