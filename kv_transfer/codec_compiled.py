"""torch.compile'd fp8 kernels for CPU caches (on unless ``PDSERVE_KV_COMPILE=0``).

Inductor fuses amax, scaling and the e4m3 cast into one vectorized loop:
~7 GiB/s of bf16 per core against ~2.5 for the eager ops. Compiling takes
tens of seconds (cached on disk afterwards), so it runs on a background
thread, started by the first fp8 receiver on a CPU cache or the first fp8
use; until it is ready — or if there is no C++ compiler — the eager path
runs. Results are checked against the eager codec's bounds on a sample
before they are used. Both paths decode each other's payloads.
"""

from __future__ import annotations

import os
import threading

import torch

FP8 = torch.float8_e4m3fn
_state: dict[str, object] = {}
_lock = threading.Lock()


# Callers flatten to [groups, B*D] so one dynamic-shape graph per dtype serves every chunk
# (6-D shapes recompile whenever a dim happens to be 1 or equal to another).
def _encode(x: torch.Tensor):
    # x: [G, E] -> (data fp8 [G, E], amax float32 [G, 1])
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    inv = torch.where(amax > 0, 448.0 / amax, 0.0)
    return (x.float() * inv).to(FP8), amax


def _decode(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    return (data.float() * scales).to(dtype)


def enabled() -> bool:
    return os.environ.get("PDSERVE_KV_COMPILE", "1") != "0"


def kernels():
    """(encode, decode) once compiled and checked, else None; starts compiling on first call."""
    ready = _state.get("ready")
    if ready is not None or not enabled():
        return ready
    with _lock:
        if "thread" not in _state:
            _state["thread"] = threading.Thread(target=_build, name="kv-codec-compile", daemon=True)
            _state["thread"].start()
    return None


def wait_ready(timeout: float | None = None) -> bool:
    kernels()
    thread = _state.get("thread")
    if thread is not None:
        thread.join(timeout)
    return _state.get("ready") is not None


def _build() -> None:
    try:
        torch.set_num_threads(1)
        encode = torch.compile(_encode, dynamic=True)
        decode = torch.compile(_decode, dynamic=True)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(6, 1024).to(dtype)
            data, amax = encode(x)
            y = decode(data, amax / 448.0, dtype)
            if not bool(((y.float() - x.float()).abs() <= x.float().abs() * 2**-3 + amax * 2**-9).all()):
                return
        _state["ready"] = (encode, decode)
    except Exception:  # no compiler, unsupported op: stay on the eager path
        return
