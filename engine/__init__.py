"""Shared model runtime: the Llama-family model, paged KV cache, scheduler, sampler and colocated Engine.

    engine.py, args.py   Engine (schedule → run → postprocess) and EngineArgs, its one configuration
    model/               the model and its layers (linear + weight layouts, attention back-ends, RoPE,
                         loader, presets)
    kv_cache/            block manager and prefix cache, its events, prompt KV, the cache's memory budget
    scheduling/          requests, the scheduler, the engine loop thread
    sampling/            sampling parameters, the sampler, generation_config.json
    runner/              one model call per step, the per-layer hook, decode CUDA graphs
    output/              detokenize and stop; outputs as wire events
    parallel/            tensor parallelism: head shards, the rank group, rank 0's step plans
    spec/                speculative decoding (to come)
    tokenizer.py, profile.py, cost_model.py, latency.py
    weights/             committed trained models

Names are imported on first use: `engine.sampling.params` (what a client needs) loads without torch.
"""
from __future__ import annotations

import importlib

_HOME = {
    "BlockManager": "engine.kv_cache.block_manager", "prompt_block_hashes": "engine.kv_cache.block_manager",
    "ModelConfig": "engine.model.config", "Engine": "engine.engine", "EngineArgs": "engine.args",
    "PRESETS": "engine.model.presets", "init_preset": "engine.model.presets", "resolve_model": "engine.model.presets",
    "Completion": "engine.scheduling.request", "Request": "engine.scheduling.request",
    "RequestOutput": "engine.scheduling.request", "RequestStatus": "engine.scheduling.request",
    "SamplingParams": "engine.sampling.params", "StructuredOutput": "engine.sampling.structured",
    "IncrementalDetokenizer": "engine.tokenizer", "Tokenizer": "engine.tokenizer",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
