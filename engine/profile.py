"""Measure what an engine achieves on this hardware: prefill FLOP/s and decode bytes/s.

Runs the engine's own model on its own paged cache (blocks borrowed from its
block manager and returned), exactly as a step would: prefill in chunks of the
engine's `chunk_size`, decode as one batch of single tokens over contexts of a
given length. Call it on the engine's loop thread (the engine is not
thread-safe); the actors post it there with `EngineLoop.call`.

Counting (the seeds' ledger):
    prefill FLOPs(S)      = 2·P·S + 4·L·S²·d + 2·V·h        (linear, attention, one sampled row)
    decode FLOPs(B, C)    = 2·P·B + 4·L·B·C·d + 2·V·h·B
    decode bytes(B, C)    = weight bytes + B·C·(KV bytes per token)
P = matmul parameters of the decoder layers, L = layers, d = query heads · head_dim,
V·h = the LM head. Embedding lookups and norms are left out (negligible).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from engine.attention import build_metadata
from engine.config import ModelConfig


@dataclass(slots=True, frozen=True)
class ModelCosts:
    num_layers: int
    hidden_size: int
    attn_dim: int              # query heads · head_dim
    layer_params: int          # matmul parameters of all decoder layers (P)
    head_params: int           # LM head (V·h)
    weight_bytes: int          # bytes a decode step reads for weights (layers + head)
    kv_bytes_per_token: int    # K and V of one token over all layers
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int) -> "ModelCosts":
        h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        layer_params = cfg.num_hidden_layers * per_layer
        head = cfg.vocab_size * h
        return cls(cfg.num_hidden_layers, h, q, layer_params, head, (layer_params + head) * dtype_bytes,
                   cfg.kv_bytes_per_token(dtype_bytes), dtype_bytes)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelCosts":
        return cls(**{k: d[k] for k in cls.__slots__})

    def to_dict(self) -> dict:
        return asdict(self)

    def prefill_flops(self, prompt_len: int) -> float:
        s = prompt_len
        return 2.0 * self.layer_params * s + 4.0 * self.num_layers * s * s * self.attn_dim + 2.0 * self.head_params

    def decode_flops(self, batch: int, context: int) -> float:
        return batch * (2.0 * (self.layer_params + self.head_params) + 4.0 * self.num_layers * context * self.attn_dim)

    def decode_bytes(self, batch: int, context: int) -> float:
        return float(self.weight_bytes) + batch * context * self.kv_bytes_per_token


def engine_costs(engine) -> ModelCosts:
    return ModelCosts.of(engine.config, engine.dtype.itemsize)


def describe(engine) -> dict:
    """What a profile was measured on (saved beside the points)."""
    return {"model_dir": engine.model_dir, "fingerprint": engine.fingerprint, "dtype": str(engine.dtype),
            "device": str(engine.device), "torch_threads": torch.get_num_threads(),
            "block_size": engine.block_size, "kv_blocks": engine.block_manager.num_blocks,
            "chunk_size": engine.scheduler.chunk_size if hasattr(engine.scheduler, "chunk_size") else None,
            "costs": engine_costs(engine).to_dict()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunk_size(engine) -> int | None:
    return getattr(engine.scheduler, "chunk_size", None)


def measure_prefill(engine, prompt_len: int, repeats: int = 1, seed: int = 0) -> dict | None:
    """Time one fresh prompt of `prompt_len` tokens, chunked as the engine would chunk it.

    Returns {"prompt_len", "seconds", "flops", "flops_per_s"} (best of `repeats`),
    or None when the engine has too few free blocks or the context is too long.
    """
    bs = engine.block_size
    if prompt_len > engine.max_model_len:
        return None
    table = engine.block_manager.allocate(-(-prompt_len // bs))
    if table is None:
        return None
    try:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, engine.vocab_size, (prompt_len,), generator=g).to(engine.device)
        chunk = _chunk_size(engine) or prompt_len
        best = float("inf")
        for _ in range(repeats):
            _sync(engine.device)
            t0 = time.perf_counter()
            for start in range(0, prompt_len, chunk):
                n = min(chunk, prompt_len - start)
                meta = build_metadata([(start, n, table)], bs, engine.device)
                last = torch.tensor([n - 1], dtype=torch.long, device=engine.device)
                engine.model(ids[start:start + n], torch.arange(start, start + n, device=engine.device),
                             engine.kv_cache, meta, last)
            _sync(engine.device)
            best = min(best, time.perf_counter() - t0)
    finally:
        engine.block_manager.free(table)
    flops = engine_costs(engine).prefill_flops(prompt_len)
    return {"prompt_len": prompt_len, "seconds": best, "flops": flops, "flops_per_s": flops / best}


def measure_decode(engine, batch: int, context: int, repeats: int = 3, seed: int = 0) -> dict | None:
    """Time one decode step of `batch` sequences that each hold `context` tokens of KV.

    Every sequence gets its own blocks (so the step reads batch·context tokens of
    KV, as in serving). Returns {"batch", "context", "seconds", "bytes",
    "bytes_per_s", "flops"} (best of `repeats`, after one warm-up), or None when
    the blocks do not fit.
    """
    bs = engine.block_size
    if context + 1 > engine.max_model_len:
        return None
    per_seq = -(-(context + 1) // bs)
    table = engine.block_manager.allocate(per_seq * batch)
    if table is None:
        return None
    try:
        tables = [table[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, engine.vocab_size, (batch,), generator=g).to(engine.device)
        positions = torch.full((batch,), context, dtype=torch.long, device=engine.device)
        rows = torch.arange(batch, device=engine.device)
        best = float("inf")
        for i in range(repeats + 1):
            _sync(engine.device)
            t0 = time.perf_counter()
            meta = build_metadata([(context, 1, t) for t in tables], bs, engine.device)
            engine.model(ids, positions, engine.kv_cache, meta, rows)
            _sync(engine.device)
            if i:                        # the first run warms caches and allocator
                best = min(best, time.perf_counter() - t0)
    finally:
        engine.block_manager.free(table)
    costs = engine_costs(engine)
    nbytes = costs.decode_bytes(batch, context)
    return {"batch": batch, "context": context, "seconds": best, "bytes": nbytes, "bytes_per_s": nbytes / best,
            "flops": costs.decode_flops(batch, context)}


def run_point(engine, point: dict) -> dict | None:
    """One measurement: {"kind": "prefill", "prompt_len": S} or {"kind": "decode", "batch": B, "context": C}."""
    repeats = point.get("repeats")
    if point["kind"] == "prefill":
        return measure_prefill(engine, point["prompt_len"], repeats or 1)
    if point["kind"] == "decode":
        return measure_decode(engine, point["batch"], point["context"], repeats or 3)
    if point["kind"] == "describe":
        return describe(engine)
    raise ValueError(f"kind must be prefill, decode or describe; got {point['kind']!r}")
