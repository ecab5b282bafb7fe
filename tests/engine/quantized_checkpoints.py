"""Small quantized checkpoints in the GPTQ, AWQ and compressed-tensors formats, written here from each
format's own definition (not through pdserve's readers), beside a float checkpoint of the weights they
stand for (the dequantized reference).

A float checkpoint's projections are quantized round-to-nearest (asymmetric, integer zero points
for GPTQ / AWQ; symmetric for compressed-tensors), packed as the format packs them, and saved with
config.json's `quantization_config`; the reference directory holds (q - z) * s in float32.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # AutoAWQ's order_map: nibble i of word j holds column 8j + order[i]


def rtn(weight: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] in 0..15, integer zeros [N, G], scales [N, G] (fp16-representable): w ≈ (q - z) * s."""
    n, k = weight.shape
    group = k if group == -1 else group
    w = weight.float().view(n, k // group, group)
    if symmetric:
        scales = (w.abs().amax(-1) / 7).half().float()
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).half().float()
        zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return codes.view(n, k).to(torch.int64), zeros.to(torch.int64), scales


def dequantize(codes, zeros, scales, group: int) -> torch.Tensor:
    n, k = codes.shape
    group = k if group == -1 else group
    q = codes.float().view(n, k // group, group)
    return ((q - zeros[..., None].float()) * scales[..., None]).view(n, k)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibbles (index i at bits 4i) -> int32 words."""
    word = sum((nibbles[..., i] & 15) << (4 * i) for i in range(8))
    return ((word + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def pack_gptq(codes, zeros, scales, group: int, v2: bool = False) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight [K/8, N] packs 8 input rows per word; qzeros [G, N/8] packs 8 output columns,
    storing zero - 1 (format gptq; gptq_v2 stores the zero); scales [G, N] fp16; g_idx [K]."""
    n, k = codes.shape
    qweight = _words(codes.t().reshape(k // 8, 8, n).permute(0, 2, 1))
    stored = zeros.t() - (0 if v2 else 1)                                   # [G, N]
    qzeros = _words(stored.reshape(stored.shape[0], n // 8, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().half().contiguous(),
            "g_idx": (torch.arange(k) // (k if group == -1 else group)).to(torch.int32)}


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AutoAWQ (gemm): qweight [K, N/8] and qzeros [G, N/8] pack 8 output columns per word in AWQ_ORDER."""
    def pack(t: torch.Tensor) -> torch.Tensor:                              # t: [rows, N]
        cols = t.reshape(t.shape[0], t.shape[1] // 8, 8)
        return _words(torch.stack([cols[..., AWQ_ORDER[i]] for i in range(8)], dim=-1))
    return {"qweight": pack(codes.t()), "qzeros": pack(zeros.t()), "scales": scales.t().half().contiguous()}


def pack_compressed_tensors(codes, scales) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: weight_packed [N, K/8] (codes, i.e. signed value + 8, low
    nibble first), weight_scale [N, G], weight_shape [2]."""
    n, k = codes.shape
    return {"weight_packed": _words(codes.reshape(n, k // 8, 8)), "weight_scale": scales.to(torch.bfloat16),
            "weight_shape": torch.tensor([n, k], dtype=torch.int32)}


QUANTIZATION_CONFIGS = {
    "gptq": lambda group: {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
                           "checkpoint_format": "gptq"},
    "gptq_v2": lambda group: {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                              "sym": False, "checkpoint_format": "gptq_v2"},
    "awq": lambda group: {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                          "version": "gemm"},
    "compressed-tensors": lambda group: {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel" if group == -1 else "group",
            "group_size": None if group == -1 else group, "actorder": None}}}},
}


def write_quantized(float_dir: str, out_dir: str, ref_dir: str, fmt: str, group: int,
                    skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """Quantize `float_dir`'s decoder projections into `out_dir` in format `fmt` (GPTQ also gets the zero
    biases its exporters write); `ref_dir` gets the dequantized float weights. Projections whose name
    contains one of `skip` stay float in both. Returns (out_dir, ref_dir)."""
    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in weights.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.split("layers.")[-1].split(".", 1)[-1] in PROJECTIONS) \
                or any(s in name for s in skip):
            quantized[name] = reference[name] = tensor
            continue
        codes, zeros, scales = rtn(tensor, group, symmetric=fmt == "compressed-tensors")
        if fmt == "compressed-tensors":                     # its scales are stored bfloat16 here
            scales = scales.to(torch.bfloat16).float()
        reference[name] = dequantize(codes, zeros, scales, group).contiguous()
        if fmt == "compressed-tensors":
            packed = pack_compressed_tensors(codes, scales)
        elif fmt == "awq":
            packed = pack_awq(codes, zeros, scales)
        else:
            packed = pack_gptq(codes, zeros, scales, group, v2=fmt == "gptq_v2")
            packed["bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
        quantized.update({f"{prefix}.{key}": value.contiguous() for key, value in packed.items()})
    for directory, tensors in ((out_dir, quantized), (ref_dir, reference)):
        shutil.copytree(float_dir, directory)
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["quantization_config"] = QUANTIZATION_CONFIGS[fmt](group)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    return out_dir, ref_dir
