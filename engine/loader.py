"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) from disk."""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import LlamaModel

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a directory: those the index names, or the single file."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: weight shard named in {INDEX_FILE} is missing")
    return files


def read_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name)
    return state


def load_model(model_dir: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int) -> LlamaModel:
    """Build the model and copy HF weights into it, fusing q/k/v and gate/up."""
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions, torch.device("meta"), dtype)
    model = model.to_empty(device=device)
    model.rope = type(model.rope)(cfg, max_positions, device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    src = read_state_dict(model_dir)
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"{model_dir}: weight {name!r} is missing from the safetensors files")
        taken.add(name)
        return src[name]

    with torch.no_grad():
        model.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        model.norm.weight.copy_(take("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            attn = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            layer.qkv_proj.weight.copy_(torch.cat(attn))
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            gate_up = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            layer.gate_up_proj.weight.copy_(torch.cat(gate_up))
            layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]))
                layer.down_proj.bias.copy_(take(p + "mlp.down_proj.bias"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
    unused = [n for n in src if n not in taken and not n.endswith("rotary_emb.inv_freq")
              and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unused:
        raise ValueError(f"{model_dir}: unexpected weights for {cfg.model_type}: {unused[:5]}")
    return model.eval()


def fingerprint(model_dir: str, cfg: ModelConfig) -> str:
    """A short id of the weights + architecture: both ends of a KV transfer must agree on it."""
    h = hashlib.sha256(json.dumps(cfg.__repr__()).encode())
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 1 << 20)))
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(8 + header_len, size - (1 << 16)))
            h.update(f.read(1 << 16))      # tail bytes: different random weights differ here
        h.update(str(size).encode())
    return h.hexdigest()[:16]
