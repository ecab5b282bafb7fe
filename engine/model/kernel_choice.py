"""Per-machine kernel and layout choices: measured at start-up at the model's shapes, cached on disk.

A choice that wins on one CPU can lose on another (the projection weights' layout, engine/model/linear.py;
the compiled decode attention against the gather + bmm path). So the engine times the alternatives
per operation once per machine and shape, keyed by the CPU model and its ISA flags, the torch version
and the shapes, and keeps the figures in `kernel_choices.json` beside Inductor's compiled-kernel cache
(`$PDSERVE_CHOICE_CACHE` overrides the file); later engines on the machine read them.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable

import torch

from engine.model.linear import (INPUT_MAJOR, ONEDNN_PACKED, PACKED_WITH_GEMV, ROW_MAJOR, Linear, layouts_for, linear,
                                 relayout)
from engine.model.quantization import quantize
from engine.model.quantized_linear import QuantizedLinear, QuantPlan

log = logging.getLogger(__name__)
CACHE_ENV = "PDSERVE_CHOICE_CACHE"
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "fma", "asimd", "sve")


@functools.cache
def cpu_identity() -> str:
    """CPU model name and the ISA flags that pick BLAS/Inductor kernels."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and name in (platform.processor(), platform.machine()):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in _FLAGS if f in flags)}]"


def machine_key() -> str:
    """Not the thread count: every process of a machine (a test and its actors, differently threaded)
    must make the same choice, or float32 results would differ in the last bits between them."""
    return f"{cpu_identity()} | torch {torch.__version__}"


def cache_path() -> str:
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        root = cache_dir()
    except Exception:                      # an older/newer torch without that helper
        root = os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return os.path.join(root, "kernel_choices.json")


def best_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best wall time of `repeats` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):          # missing or unreadable: measure again
        return {}


def _store(path: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)              # atomic: engines starting together never read half a file
    except OSError as exc:
        log.warning("kernel choices not cached (%s)", exc)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on `path`.lock (no lock where the folder cannot be written: measure anyway)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        handle = open(f"{path}.lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure(name: str, shapes: tuple, candidates: dict[str, Callable[[], object]],
            timer: Callable[[Callable[[], object]], float] | None = None, path: str | None = None) -> dict:
    """Seconds of each candidate for this operation on this machine at these shapes (cached on disk).

    `timer(fn) -> seconds` (default `best_time`) times one candidate."""
    path = path or cache_path()
    timer = timer or best_time
    key = hashlib.sha256(f"{name} | {machine_key()} | {shapes}".encode()).hexdigest()[:24]

    def cached() -> dict | None:
        hit = _load(path).get(key)
        ok = isinstance(hit, dict) and isinstance(hit.get("seconds"), dict) and set(hit["seconds"]) == set(candidates)
        return hit["seconds"] if ok else None
    seconds = cached()
    if seconds is not None:
        return seconds
    with _locked(path):                    # engines starting together: one measures, the rest read its figures
        seconds = cached()
        if seconds is not None:
            return seconds
        seconds = {label: timer(fn) for label, fn in candidates.items()}
        cache = _load(path)
        cache[key] = {"name": name, "machine": machine_key(), "shapes": repr(shapes), "seconds": seconds,
                      "choice": min(seconds, key=seconds.get)}
        _store(path, cache)
    log.info("measured %s at %s: %s", name, shapes, ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in seconds.items()))
    return seconds


def choose(name: str, shapes: tuple, candidates: dict[str, Callable[[], object]],
           timer: Callable[[Callable[[], object]], float] | None = None, path: str | None = None) -> str:
    """The fastest candidate's label (`measure`)."""
    seconds = measure(name, shapes, candidates, timer, path)
    return min(seconds, key=seconds.get)


PREFILL_SLACK = 1.03      # a weight layout may cost prefill GEMMs at most 3% for a faster decode
DECODE_ROWS = (1, 8, 32)  # decode batch sizes a layout is timed at (rows of the GEMM)
SECOND_COPY_MAX_SHARE = 0.125   # PACKED_WITH_GEMV's second copy of the weights: at most this share of RAM


def _linears(layout: str, weights: Callable[[str], list], inputs: Callable[[], list]) -> None:
    """One layer's projections in `layout`; `weights(layout)` and `inputs()` are built on the first
    (warm-up) call, so a machine whose figures are cached never builds them."""
    with torch.inference_mode():
        for w, x in zip(weights(layout), inputs()):
            linear(x, w)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def weight_layout(model, prefill_tokens: int = 256, memory: int | None = None) -> str:
    """The layout this machine should store the model's projection weights in (engine/model/linear.py).

    Timed per operation on one decoder layer's projections in each single-copy layout the weights'
    dtype and device allow: decode GEMMs of `DECODE_ROWS` rows and a `prefill_tokens`-row prefill
    GEMM (`PACKED_WITH_GEMV` runs 1 row as input-major and more as packed, so it takes those
    figures). The layout with the fastest decode (geometric mean over the batch sizes, relative to
    row-major) wins among those that cost prefill at most `PREFILL_SLACK` over row-major;
    `PACKED_WITH_GEMV` only while its second copy of the weights fits in `SECOND_COPY_MAX_SHARE` of
    `memory` (default: this machine's RAM).
    """
    layer = model.layers[0]
    dense = [m for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) if isinstance(m, Linear)]
    if not dense and isinstance(model.lm_head, Linear) and model.lm_head.weight is not model.embed_tokens.weight:
        dense = [model.lm_head]       # quantized projections (quantized_linear.py): only the LM head is dense
    if not dense:
        return ROW_MAJOR
    weights = [m.weight.detach() for m in dense]
    layouts = layouts_for(weights[0])
    if len(layouts) == 1:
        return layouts[0]
    single = [layout for layout in layouts if layout != PACKED_WITH_GEMV]
    stored = functools.cache(lambda layout: [relayout(w, layout) for w in weights])
    shapes = tuple(tuple(w.shape) for w in weights) + (str(weights[0].dtype),)
    gen = torch.Generator().manual_seed(0)

    def seconds_at(name: str, rows: int) -> dict[str, float]:
        inputs = functools.cache(lambda: [torch.randn(rows, w.shape[1], generator=gen).to(w.dtype) for w in weights])
        seconds = measure(name, shapes + (rows,),
                          {layout: functools.partial(_linears, layout, stored, inputs) for layout in single})
        if PACKED_WITH_GEMV in layouts:
            seconds = {**seconds, PACKED_WITH_GEMV: seconds[INPUT_MAJOR if rows == 1 else ONEDNN_PACKED]}
        return seconds
    decode = [seconds_at("weight_layout/decode", rows) for rows in DECODE_ROWS]
    prefill = seconds_at("weight_layout/prefill", prefill_tokens)

    def decode_cost(layout: str) -> float:    # geometric mean of the time over row-major's
        return math.prod(d[layout] / d[ROW_MAJOR] for d in decode) ** (1 / len(decode))
    second_copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                      if isinstance(m, Linear) and m.weight is not model.embed_tokens.weight)
    memory = _physical_memory() if memory is None else memory
    allowed = [layout for layout in layouts if prefill[layout] <= PREFILL_SLACK * prefill[ROW_MAJOR]
               and (layout != PACKED_WITH_GEMV or second_copy <= SECOND_COPY_MAX_SHARE * memory)]
    choice = min(allowed, key=lambda layout: (decode_cost(layout), layout != ROW_MAJOR))
    log.info("weight layout %s (decode time vs row-major: %s)", choice,
             ", ".join(f"{layout} {decode_cost(layout):.2f}" for layout in allowed))
    return choice


DENSE_ROWS = (2, 4, 8, 16)   # row counts the dense copy of `PACKED_WITH_GEMV` is timed at against packed
DENSE_SLACK = 1.10           # the dense copy keeps a row count unless packed is this much faster alone


def _products(mods: list, inputs: list, dense: bool) -> None:
    with torch.inference_mode():
        for m, x in zip(mods, inputs):
            linear(x, m.weight if dense else m.packed)


def dense_rows(model) -> int:
    """For weights stored `PACKED_WITH_GEMV`: the most rows up to which a product runs faster on the
    dense (input-major) copy than on the packed weight, timed on one decoder layer's projections at
    `DENSE_ROWS` (cached per machine); 1 when packed wins at 2 rows. Timed alone, a product does not
    show what switching copies costs in a serving loop (the 1-row steps in between read the dense copy;
    a product on the packed one pulls a second copy of the weights through the caches), so the dense
    copy keeps a row count unless packed is `DENSE_SLACK` faster. A speculative step's verification
    rows and small batches take the dense copy below the crossover."""
    layer = model.layers[0]
    mods = [m for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if isinstance(m, Linear) and m.layout == PACKED_WITH_GEMV]
    if not mods:
        return 1
    shapes = tuple(tuple(m.packed.shape) for m in mods) + (str(mods[0].weight.dtype),)
    gen = torch.Generator().manual_seed(0)
    most = 1
    for rows in DENSE_ROWS:
        inputs = [torch.randn(rows, m.in_features, generator=gen).to(m.weight.dtype) for m in mods]
        seconds = measure("weight_layout/dense_rows", shapes + (rows,),
                          {INPUT_MAJOR: functools.partial(_products, mods, inputs, True),
                           ONEDNN_PACKED: functools.partial(_products, mods, inputs, False)})
        if seconds[INPUT_MAJOR] > DENSE_SLACK * seconds[ONEDNN_PACKED]:
            break
        most = rows
    return most


QUANT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)   # row counts the packed kernel is timed at against the dense path


def quantized_plan(cfg, scheme: str, group_size: int, dtype: torch.dtype, device: torch.device,
                   prefill_tokens: int = 256) -> QuantPlan:
    """How this machine should multiply by int8 / int4 weights (engine/model/quantized_linear.py).

    The packed kernel takes bfloat16 activations on CPU: torch vectorizes its CPU weight-only kernels
    for bfloat16 only (a float32 product of 1 row ran 13-25x slower here), so that is not timed.
    Timed on one decoder layer's projections at the model's shapes (random weights): the dense
    path's dtype (the model's, or bfloat16) at a `prefill_tokens`-row product; then
    `max_kernel_rows`: the most rows in `QUANT_ROWS` up to which the kernel beats the dense path at
    every count (0: even one row is faster dense). On CUDA a fixed plan (not measured): int4 through
    tinygemm up to 16 rows in bfloat16, int8 dense.
    """
    if device.type != "cpu":
        return QuantPlan(scheme, group_size, torch.bfloat16, dtype, 16 if scheme == "int4" else 0)
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = ((q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size))
    dtypes = tuple(dict.fromkeys((dtype, torch.bfloat16)))
    gen = torch.Generator().manual_seed(0)
    weights = functools.cache(lambda: [quantize(torch.randn(n, k, generator=gen), scheme, group_size)
                                       for n, k in shapes])

    @functools.cache
    def layer(kernel_dtype: torch.dtype, dense_dtype: torch.dtype) -> list:
        plan = QuantPlan(scheme, group_size, kernel_dtype, dense_dtype, 0)
        modules = [QuantizedLinear(k, n, False, plan) for n, k in shapes]
        for m, w in zip(modules, weights()):
            m.set_weight(w)
        return modules

    def timed(path: str, kernel_dtype: torch.dtype, dense_dtype: torch.dtype, rows: int):
        inputs = functools.cache(lambda: [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes])

        def run() -> None:
            with torch.inference_mode():
                for m, x in zip(layer(kernel_dtype, dense_dtype), inputs()):
                    getattr(m, path)(x)
        return run
    key = shapes + (scheme, group_size, str(dtype))
    kernel_dtype = torch.bfloat16
    dense_s = measure("quantized/dense", key + (prefill_tokens,),
                      {str(d): timed("dense", kernel_dtype, d, prefill_tokens) for d in dtypes})
    dense_dtype = min(dtypes, key=lambda d: dense_s[str(d)])
    max_rows = 0
    for rows in QUANT_ROWS:
        seconds = measure("quantized/rows", key + (rows, str(kernel_dtype), str(dense_dtype)), {
            "kernel": timed("kernel", kernel_dtype, dense_dtype, rows),
            "dense": timed("dense", kernel_dtype, dense_dtype, rows)})
        if seconds["kernel"] > seconds["dense"]:
            break
        max_rows = rows
    plan = QuantPlan(scheme, group_size, kernel_dtype, dense_dtype, max_rows)
    log.info("quantized projections: %s", plan)
    return plan


def settle(device: torch.device) -> None:
    """Wait for the device's queued kernels (a CUDA call returns once launched: time it to completion)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_decode_wins(kernel, layer_cache: torch.Tensor, num_heads: int, batch: int = 16,
                         context: int = 256) -> bool:
    """Is the compiled decode attention faster than the gather + bmm path here, at this model's shapes?"""
    from engine.model.attention import decode_attention, gather_kv
    fmt = kernel.kv_format              # a quantized cache's format, or None
    if fmt is None:
        num_blocks, _, num_kv_heads, block_size, dim = layer_cache.shape
        dtype, stored = layer_cache.dtype, str(layer_cache.dtype)
    else:
        num_blocks, num_kv_heads, block_size, dim = layer_cache.shape[0], fmt.num_kv_heads, fmt.block_size, fmt.head_dim
        dtype, stored = fmt.dtype, f"{fmt.kind}/{fmt.dtype}"
    width = max(min(-(-context // block_size), num_blocks // batch), 2)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randint(0, num_blocks, (batch, width), generator=gen).to(layer_cache.device)
    bias = torch.zeros(batch, width * block_size, device=layer_cache.device)
    with torch.inference_mode():
        q = torch.randn(batch, num_heads, dim, generator=gen).to(layer_cache.device, dtype)

        def compiled() -> None:
            with torch.inference_mode():
                kernel(q, layer_cache, tables, bias, dim ** -0.5)
            settle(layer_cache.device)

        def eager() -> None:
            with torch.inference_mode():
                decode_attention(q, gather_kv(layer_cache, tables, fmt), bias, dim ** -0.5)
            settle(layer_cache.device)
    shapes = (num_heads, num_kv_heads, block_size, dim, stored, batch, width)
    return choose("decode_attention", shapes, {"compiled": compiled, "eager": eager}) == "compiled"
