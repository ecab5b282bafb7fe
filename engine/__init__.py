"""Shared model runtime: the Llama-family model, paged KV cache, scheduler and colocated Engine.

Names are imported on first use: `engine.sampling_params` (what a client needs) loads without torch.
"""
from __future__ import annotations

import importlib

_HOME = {
    "BlockManager": "engine.block_manager", "prompt_block_hashes": "engine.block_manager",
    "ModelConfig": "engine.config", "Engine": "engine.engine",
    "PRESETS": "engine.presets", "init_preset": "engine.presets", "resolve_model": "engine.presets",
    "Completion": "engine.request", "Request": "engine.request", "RequestOutput": "engine.request",
    "RequestStatus": "engine.request", "SamplingParams": "engine.sampling_params",
    "IncrementalDetokenizer": "engine.tokenizer", "Tokenizer": "engine.tokenizer",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
