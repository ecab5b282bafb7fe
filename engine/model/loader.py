"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) from disk.

Weights must be bf16/fp16/fp32 safetensors, one file or sharded with
`model.safetensors.index.json`. Anything else (pickled `.bin` checkpoints, quantized
tensors, a missing shard) is refused with an error naming the file and what was found.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.model import LlamaModel

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tensor-name endings that only quantized checkpoints (GPTQ, AWQ, bitsandbytes, fp8) carry.
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                      ".input_scale", ".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
                      ".quant_state.bitsandbytes__fp4", ".SCB")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a directory: those the index names, or the single file."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e!r}") from None
        names = sorted(set(weight_map.values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        pickled = sorted(n for n in os.listdir(model_dir) if n.endswith(PICKLE_SUFFIXES))
        if pickled:
            raise ValueError(f"{model_dir}: only pickled PyTorch weights found ({', '.join(pickled[:3])}); "
                             "pdserve loads safetensors only (convert them, e.g. save_pretrained("
                             "safe_serialization=True))")
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: weight shard named in {INDEX_FILE} is missing")
    return files


def read_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, refusing quantized or non-float ones."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(QUANTIZED_SUFFIXES):
                    raise ValueError(f"{path}: tensor {name!r} belongs to a quantized checkpoint "
                                     "(GPTQ/AWQ/bitsandbytes/fp8); pdserve loads bf16/fp16/fp32 weights only")
                t = f.get_tensor(name)
                if t.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype} (a quantized checkpoint?); "
                                     "pdserve loads bf16/fp16/fp32 weights only")
                state[name] = t
    return state


def load_model(model_dir: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int) -> LlamaModel:
    """Build the model and copy HF weights into it, fusing q/k/v and gate/up (Phi-3 ships them fused)."""
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

    def copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if param.shape != value.shape:
            raise ValueError(f"{model_dir}: weight {name!r} has shape {tuple(value.shape)}, "
                             f"config.json implies {tuple(param.shape)}")
        param.copy_(value)

    fused = cfg.model_type == "phi3"
    with torch.no_grad():
        copy(model.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        copy(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            copy(model.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            if fused:
                qkv, gate_up = take(p + "self_attn.qkv_proj.weight"), take(p + "mlp.gate_up_proj.weight")
            else:
                qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
                gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            copy(layer.qkv_proj.weight, qkv, p + "self_attn.qkv_proj.weight")
            copy(layer.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            copy(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if cfg.o_proj_bias:
                copy(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            copy(layer.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]))
                layer.down_proj.bias.copy_(take(p + "mlp.down_proj.bias"))
            if cfg.qk_norm:
                copy(layer.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                copy(layer.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                copy(getattr(layer, norm).weight, take(p + norm + ".weight"), p + norm + ".weight")
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
