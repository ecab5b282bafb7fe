"""Measure what an engine achieves on this hardware: prefill FLOP/s and decode bytes/s.

Drives the engine's own steps (scheduler → runner → sampler → output) on its own
paged cache, so batching, chunking and per-step overheads are those of serving:
prefill of fresh random prompts (one, or as many as a saturated step takes), decode
steps of adopted sequences holding a given context. Everything is aborted and its
blocks freed afterwards. The engine must be idle; call it on the engine's loop thread
(the engine is not thread-safe) — the actors post it there with `EngineLoop.call`.

FLOPs and bytes of each point are counted by `engine.cost_model` (the seeds' ledger).
"""
from __future__ import annotations

import time

import torch

from engine.cost_model import ModelCosts
from engine.sampling.params import SamplingParams


def engine_costs(engine) -> ModelCosts:
    return ModelCosts.of(engine.config, engine.dtype.itemsize, engine.model.quantized_weights(),
                         engine.kv_format.bytes_per_token)


def describe(engine) -> dict:
    """What a profile was measured on (saved beside the points)."""
    return {"model_dir": engine.model_dir, "fingerprint": engine.fingerprint, "dtype": str(engine.dtype),
            "quantization": engine.model.quantization, "kv_cache_dtype": engine.kv_format.kind,
            "device": str(engine.device), "torch_threads": torch.get_num_threads(),
            "block_size": engine.block_size, "kv_blocks": engine.block_manager.num_blocks,
            "chunk_size": engine.scheduler.chunk_size if hasattr(engine.scheduler, "chunk_size") else None,
            "costs": engine_costs(engine).to_dict()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_ids(engine, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, engine.vocab_size, (n,), generator=gen).tolist()


def _check_idle(engine) -> None:
    if engine.requests or engine.has_unfinished():
        raise RuntimeError("engine is busy: profile an idle engine (its steps would mix with live requests)")


def prefill_batch_size(engine, prompt_len: int) -> int:
    """Prompts of `prompt_len` one step takes under saturation (token budget, max_num_seqs)."""
    return max(1, min(engine.scheduler.max_num_batched_tokens // max(prompt_len, 1), engine.scheduler.max_num_seqs))


def measure_prefill(engine, prompt_len: int, batch: int = 1, repeats: int = 1, seed: int = 0) -> dict | None:
    """Prefill `batch` fresh prompts of `prompt_len` tokens through the engine's own steps
    (scheduler → runner → sampler: batched and chunked exactly as served), prefill-only.

    Returns {"prompt_len", "batch", "seconds", "flops", "flops_per_s"} (best of `repeats`,
    seconds for the whole batch), or None when the blocks or the context do not fit.
    """
    _check_idle(engine)
    bs = engine.block_size
    if prompt_len + 1 > engine.max_model_len:
        return None
    if not engine.block_manager.can_allocate(batch * -(-(prompt_len + 1) // bs)):
        return None
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        ids = [engine.add_request(_random_ids(engine, prompt_len, gen), params, prefill_only=True)
               for _ in range(batch)]   # fresh random prompts: no prefix-cache hits
        pending = set(ids)
        _sync(engine.device)
        t0 = time.perf_counter()
        try:
            while pending:
                for out in engine.step():
                    pending.discard(out.request_id)
            _sync(engine.device)
            best = min(best, time.perf_counter() - t0)
        finally:
            for rid in ids:
                engine.abort(rid)
    flops = batch * engine_costs(engine).prefill_flops(prompt_len)
    return {"prompt_len": prompt_len, "batch": batch, "seconds": best, "flops": flops, "flops_per_s": flops / best}


def measure_decode(engine, batch: int, context: int, repeats: int = 3, seed: int = 0) -> dict | None:
    """Time the engine's decode step (scheduler → runner → sampler → output) for `batch`
    running sequences that each hold `context` tokens of KV in their own blocks (adopted,
    as a decode actor adopts shipped KV).

    Returns {"batch", "context", "seconds", "bytes", "bytes_per_s", "flops"} (best of
    `repeats` steps after one warm-up step), or None when the blocks do not fit.
    """
    _check_idle(engine)
    bs = engine.block_size
    steps = repeats + 1
    if context + steps + 1 > engine.max_model_len:
        return None
    if not engine.block_manager.can_allocate(batch * -(-(context + steps + 1) // bs)):
        return None
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = []
    best = float("inf")
    try:
        for i in range(batch):
            blocks = engine.block_manager.allocate(-(-context // bs))
            rid = f"profile-decode-{i}"
            engine.expect_kv(rid, _random_ids(engine, context, gen), params, rid, float("inf"))
            engine.adopt(rid, [2], blocks)
            ids.append(rid)
        for i in range(steps):
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.step()
            _sync(engine.device)
            if i:                        # the first step warms caches and the allocator
                best = min(best, time.perf_counter() - t0)
    finally:
        for rid in ids:
            engine.abort(rid)
    costs = engine_costs(engine)
    nbytes = costs.decode_bytes(batch, context)
    return {"batch": batch, "context": context, "seconds": best, "bytes": nbytes, "bytes_per_s": nbytes / best,
            "flops": costs.decode_flops(batch, context)}


def run_point(engine, point: dict) -> dict | None:
    """One measurement: {"kind": "prefill", "prompt_len": S, "batch": k | "saturated"},
    {"kind": "decode", "batch": B, "context": C} or {"kind": "describe"}; optional "repeats"."""
    repeats = point.get("repeats")
    if point["kind"] == "prefill":
        batch = point.get("batch") or 1
        if batch == "saturated":
            batch = prefill_batch_size(engine, point["prompt_len"])
        return measure_prefill(engine, point["prompt_len"], batch, repeats or 1)
    if point["kind"] == "decode":
        return measure_decode(engine, point["batch"], point["context"], repeats or 3)
    if point["kind"] == "describe":
        return describe(engine)
    raise ValueError(f"kind must be prefill, decode or describe; got {point['kind']!r}")
