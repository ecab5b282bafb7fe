"""The simulated model's shape: a `ModelConfig` from a model directory or a shipped preset name.

The roofline model needs only the shape (layers, hidden size, heads, MLP width, vocabulary), so the
published models below are shipped as config.json fields, without weights:

    llama-3-8b, llama-3-70b      GQA with 8 KV heads, 128256-token vocabulary
    llama-2-7b, llama-2-13b      MHA, 32000-token vocabulary
    opt-13b, opt-66b             as their Llama-shaped equivalent (see `_opt`)

`tiny`, `small` and `pydoc` are pdserve's own models (`engine.model.presets`): their directories
are resolved (a random preset is written on first use) and read like any other.
"""
from __future__ import annotations

import os

from engine.model.config import ModelConfig
from engine.model.presets import PRESETS, TRAINED, resolve_model


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
           max_positions: int, rope_theta: float) -> dict:
    return dict(model_type="llama", hidden_act="silu", hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                vocab_size=vocab, max_position_embeddings=max_positions, rope_theta=rope_theta,
                rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")


def _opt(hidden: int, layers: int, heads: int) -> dict:
    """OPT as a Llama shape with the same parameter count per layer.

    OPT's MLP is fc1 [h → 4h], ReLU, fc2 [4h → h]: two matrices of h·4h, 8h² in all. The Llama
    shape has three (gate, up, down) of h·intermediate, so intermediate = 8h/3 gives the same
    3·h·intermediate = 8h², rounded to a multiple of 8 when 3 does not divide 8h (opt-13b: 13656, 0.02 %
    more; so the tensor-parallel degrees that split OPT's own 4h-wide MLP split this one). Attention is MHA
    with h-wide q/k/v/o, as in OPT. Left out: OPT's biases and LayerNorm shifts (a few MB), and its
    learned position embeddings (2048·h, read as a gather, never multiplied). OPT ties the LM head to
    the embedding; the 50272-token vocabulary is OPT's.
    """
    return {**_llama(hidden, 8 * round(hidden / 3), layers, heads, heads, 50272, 2048, 10000.0),
            "tie_word_embeddings": True, "torch_dtype": "float16"}


SHAPES: dict[str, dict] = {
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "llama-3-70b": _llama(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096, 10000.0),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096, 10000.0),
    "opt-13b": _opt(5120, 40, 40),
    "opt-66b": _opt(9216, 64, 72),
}
"""Shipped shapes: name → config.json fields (from each model's published config.json)."""


def shipped_names() -> list[str]:
    """Every name `model_config` takes besides a directory."""
    return [*SHAPES, *TRAINED, *PRESETS]


def model_config(spec: str) -> ModelConfig:
    """The shape of `spec`: a model directory (its config.json), a shipped shape, or a pdserve model.

    Names are case-insensitive. Raises ValueError for anything else, listing the shipped names.
    """
    if os.path.isdir(spec):
        return ModelConfig.from_dir(spec)
    name = spec.lower()
    if name in SHAPES:
        return ModelConfig.from_dict(SHAPES[name], source=f"shape {name}")
    if name in TRAINED or name in PRESETS:
        return ModelConfig.from_dir(resolve_model(name))
    raise ValueError(f"model {spec!r} is neither a directory nor a shipped name "
                     f"(shipped: {', '.join(shipped_names())})")
