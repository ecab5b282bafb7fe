"""Compiled fp8 kernels for CPU caches (on unless ``PDSERVE_KV_COMPILE=0``).

The kernels are plain C (``fp8_kernels.c``), built with the machine's C compiler for its own CPU
(``-O3 -march=native``) and called through ctypes, which lets go of the GIL while they run. Each
works straight on the paged cache, viewed as rows of cells ``[num_layers * num_blocks, 2 * kv_heads,
block_size * head_dim]``: encode reads the rows a chunk names, takes each (K/V, head) group's amax,
scales and rounds to e4m3 into the payload in one pass with no gathered copy; decode multiplies by
the scales and stores into the destination rows. Their arithmetic is torch's bit for bit (the
build is checked against torch on a sample before it is used), with the e4m3 and bfloat16 roundings
done on integer bit patterns so every loop vectorizes: on an AVX2-only EPYC core that is ~1.9 GB/s
of bf16 each way, against ~0.55 GB/s for torch.compile of the same two lines (whose e4m3
conversion is scalar without AVX-512) and ~0.5 GB/s eager.

A build takes well under a second and is cached beside Inductor's kernels, keyed by the source,
the compiler and the CPU's flags; it runs on a background thread started by the first receiver or
fp8 send. Until it is ready, for other cache dtypes than bfloat16 and float32, or without a C
compiler, the eager codec runs. Both paths decode each other's payloads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_kernels.c")
COMPILER_ENV = "CC"
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-shared", "-fPIC")  # no-trapping-math: if-convert
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_ready: dict[torch.dtype, tuple] = {}  # dtype -> (encode_rows, decode_rows), once built and checked
_thread: threading.Thread | None = None
_lock = threading.Lock()


class _Kernels:
    """encode_rows / decode_rows for one cache dtype, over tensors (checked, then handed to C)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._encode = getattr(lib, f"encode_{_SUFFIX[dtype]}")
        self._decode = getattr(lib, f"decode_{_SUFFIX[dtype]}")
        self.dtype = dtype

    def encode_rows(self, cells: torch.Tensor, rows: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> bool:
        """cells [R, G, E] (the cache); rows long [r]; data fp8 [r, G, E]; scales float32 [r, G, 1].

        Returns False when a group held NaN or Inf (its scale is not finite)."""
        _check(cells, rows, data, scales, self.dtype)
        status = self._encode(cells.data_ptr(), cells.shape[0], rows.data_ptr(), rows.numel(), cells.shape[1],
                              cells.shape[2], data.data_ptr(), scales.data_ptr())
        return _status(status, cells) == 0

    def decode_rows(self, data: torch.Tensor, scales: torch.Tensor, cells: torch.Tensor, rows: torch.Tensor) -> None:
        _check(cells, rows, data, scales, self.dtype)
        if scales.data_ptr() % 4:  # a payload as gRPC hands it over can sit at any address
            scales = scales.clone()
        _status(self._decode(data.data_ptr(), scales.data_ptr(), rows.numel(), cells.shape[1], cells.shape[2],
                             cells.data_ptr(), cells.shape[0], rows.data_ptr()), cells)


def _check(cells, rows, data, scales, dtype) -> None:
    """The C kernels index raw memory: every shape, dtype, device and layout is checked first (rows in C)."""
    num_rows, (_, groups, elems) = rows.numel(), cells.shape
    checks = {
        "cells": cells.dtype == dtype and cells.device.type == "cpu" and cells.is_contiguous(),
        "rows": rows.dtype == torch.int64 and rows.device.type == "cpu" and rows.is_contiguous() and rows.dim() == 1,
        "data": data.dtype == FP8 and data.is_contiguous() and tuple(data.shape) == (num_rows, groups, elems),
        "scales": scales.dtype == torch.float32 and scales.is_contiguous() and scales.numel() == num_rows * groups,
    }
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:  # never an assert: these guard raw memory, and python -O strips asserts
        raise ValueError(f"fp8 kernel arguments of the wrong dtype, device, layout or shape: {', '.join(wrong)}")


def _status(status: int, cells: torch.Tensor) -> int:
    if status < 0:
        raise IndexError(f"cache rows out of range [0, {cells.shape[0]})")
    return status


def release_gil_in_compiled_kernels() -> bool:
    """Make Inductor's CPU kernels let go of the GIL while they run.

    Inductor calls each C++ kernel from a small Python binding that keeps the
    GIL: a compiled kernel of 0.3 ms then stalls every other thread of the
    process (the transport's socket and gRPC threads, the decoder). The binding
    is generated from a template; this one parses the arguments with the GIL
    held, then runs the kernel without it (restored on any exit). Kernels
    only touch the raw pointers they were given. Process-wide: it covers
    every kernel compiled afterwards (the engine's decode attention), so the
    worker actors call it before building their engine. (The fp8 codec's own
    kernels are called through ctypes, which already releases the GIL.) False
    if this torch's Inductor differs.
    """
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache as bindings
    except ImportError:
        return False
    if bindings.call_entry_function != "kernel({}); Py_RETURN_NONE;":
        return "PyEval_SaveThread" in bindings.call_entry_function
    bindings.call_entry_function = (
        "auto pdserve_args = std::make_tuple({}); "
        "{{ struct Restore {{ PyThreadState* state; ~Restore() {{ PyEval_RestoreThread(state); }} }} "
        "restore{{PyEval_SaveThread()}}; std::apply(kernel, pdserve_args); }} Py_RETURN_NONE;"
    )
    return True


def enabled() -> bool:
    return os.environ.get("PDSERVE_KV_COMPILE", "1") != "0"


def kernels(dtype: torch.dtype) -> tuple | None:
    """(encode_rows, decode_rows) for a cache of ``dtype`` once built, else None.

    The first call starts the build in the background; until it is ready the eager codec runs.
    """
    if not enabled() or dtype not in _SUFFIX:
        return None
    ready = _ready.get(dtype)
    if ready is None:
        _start_build()
    return ready


def wait_ready(timeout: float | None = None) -> bool:
    """Wait for the build if one was started; True unless it failed or is still running."""
    with _lock:
        thread = _thread
    if thread is None:
        return True
    thread.join(timeout)
    return bool(_ready)


def _start_build() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build, name="kv-codec-compile", daemon=True)
            _thread.start()


def _compiler() -> str | None:
    return shutil.which(os.environ.get(COMPILER_ENV) or "cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        root = cache_dir()
    except Exception:  # an older/newer torch without that helper
        root = os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return os.path.join(root, "pdserve-kv-codec")


def library_path(compiler: str) -> str:
    """Where the build for this source, compiler and CPU lives (a shared home must not mix CPUs)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + "\0".join((version, *FLAGS, _cpu_flags())).encode()).hexdigest()[:24]
    return os.path.join(_cache_dir(), f"fp8_kernels-{key}.so")


def _build() -> None:
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        path = library_path(compiler)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
            os.close(fd)
            try:
                done = subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], capture_output=True, text=True,
                                      timeout=120)
                if done.returncode != 0:
                    raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:300]}")
                os.replace(tmp, path)  # atomic: a concurrent process loads a whole library or builds its own
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(path)
        p, n = ctypes.c_void_p, ctypes.c_int64
        built = {}
        for dtype, suffix in _SUFFIX.items():
            getattr(lib, f"encode_{suffix}").argtypes = [p, n, p, n, n, n, p, p]
            getattr(lib, f"decode_{suffix}").argtypes = [p, p, n, n, n, p, n, p]
            getattr(lib, f"encode_{suffix}").restype = getattr(lib, f"decode_{suffix}").restype = ctypes.c_int
            kernels_of_dtype = _Kernels(lib, dtype)
            mismatch = _self_check(kernels_of_dtype)
            if mismatch:
                log.warning("compiled fp8 kernels differ from torch on %s (%s); using the eager codec", dtype, mismatch)
                return
            built[dtype] = (kernels_of_dtype.encode_rows, kernels_of_dtype.decode_rows)
        _ready.update(built)
    except Exception as exc:  # no compiler, a failed build: stay on the eager path
        log.warning("cannot build the fp8 kernels (%s); using the eager codec", str(exc)[:300])
        return
    log.info("fp8 kernels ready (%s)", path)


def reference_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own fp8 encode of cells ``x [r, G, E]``: (codes [r, G, E], scales [r, G, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    inv = torch.where(amax > 0, FP8_MAX / amax, 0.0)  # all-zero group -> multiply by 0
    return (x.float() * inv).to(FP8), amax / FP8_MAX


def reference_decode(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scales).to(dtype)


def _self_check(kernels: _Kernels) -> str:
    """'' when the kernels match torch bit for bit on a sample with every magnitude; else what differs."""
    generator = torch.Generator().manual_seed(0)
    cells = torch.randn(6, 4, 96, generator=generator) * torch.logspace(-30, 30, 96)  # [R, G, E]
    cells[2, 1] = 0  # an all-zero group
    cells = cells.to(kernels.dtype)
    rows = torch.tensor([5, 2, 0, 3])
    data = torch.empty(4, 4, 96, dtype=FP8)
    scales = torch.empty(4, 4, 1)
    kernels.encode_rows(cells, rows, data, scales)
    ref_data, ref_scales = reference_encode(cells[rows])
    if not torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) or not torch.equal(scales, ref_scales):
        return "encode"
    out = torch.zeros_like(cells)
    kernels.decode_rows(data, scales, out, rows)
    return "" if torch.equal(out[rows], reference_decode(data, scales, kernels.dtype)) else "decode"
