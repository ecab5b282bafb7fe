"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) from disk.

Weights must be bf16/fp16/fp32 safetensors, one file or sharded with
`model.safetensors.index.json`, or a 4-bit GPTQ / AWQ / compressed-tensors checkpoint whose
config.json declares it (engine/model/quantized_checkpoint.py). Anything else (pickled `.bin`
checkpoints, quantized tensors in an undeclared or refused format, a missing shard, a file that is
not safetensors such as a Git LFS pointer) is refused with an error naming the file and what was found.
`quantization` int8 / int4 quantizes a float checkpoint's decoder projections at load
(engine/model/quantization.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors import safe_open

from engine.model import kernel_choice
from engine.model.config import ModelConfig
from engine.model.linear import Linear
from engine.model.model import LlamaModel
from engine.model.quantization import GROUP_SIZES, SCHEMES, concat, quantize
from engine.model.quantized_checkpoint import PACKED_NAME, QUANTIZED_SUFFIXES, read_projection
from engine.model.quantized_linear import QuantizedLinear, QuantPlan
from engine.parallel.shard import HeadShard, shard_heads, weight_slices
from engine.unreadable_file import unreadable

log = logging.getLogger(f"pdserve.{__name__}")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a directory, as transformers picks them: `model.safetensors`, else those the
    index names, else every *.safetensors file. Others beside the first two (Mistral's
    `consolidated.safetensors`, in its own tensor names) are not weights of the HF model."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
        files = [os.path.join(model_dir, SINGLE_FILE)]
    elif os.path.isfile(index):
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


def open_safetensors(path: str):
    """`safe_open(path)`; ValueError naming the file where it is not a safetensors file (a Git LFS pointer
    left by a clone without git-lfs, a download cut short)."""
    try:
        return safe_open(path, framework="pt")
    except Exception as e:          # safetensors raises its own SafetensorError (no file name in it)
        raise unreadable(path, "safetensors file", e) from None


class CheckpointTensors(Mapping):
    """The tensors of a directory's safetensors files by name, each read when it is looked up.

    Quantized or non-float tensors are refused unless config.json declares an accepted quantized format
    (`quantized`). `slices(name)` -> (dim, [(start, end), ...]) or None: the pieces of that tensor to read
    (concatenated along dim) instead of all of it, so one tensor-parallel rank reads only its shard.
    """

    def __init__(self, model_dir: str, quantized: bool = False,
                 slices: Callable[[str], tuple[int, list[tuple[int, int]]] | None] | None = None):
        self.quantized, self.slices = quantized, slices
        self.files: dict[str, object] = {}       # path -> open safe_open handle
        self.where: dict[str, str] = {}          # tensor name -> path
        for path in weight_files(model_dir):
            f = self.files[path] = open_safetensors(path)
            for name in f.keys():
                if name.endswith(QUANTIZED_SUFFIXES) and not quantized:
                    raise ValueError(f"{path}: tensor {name!r} belongs to a quantized checkpoint "
                                     "(GPTQ/AWQ/bitsandbytes/fp8) but config.json declares no quantization_config; "
                                     "pdserve loads bf16/fp16/fp32 weights, or a declared GPTQ/AWQ 4-bit checkpoint")
                self.where[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.where[name]
        f = self.files[path]
        cut = self.slices(name) if self.slices is not None else None
        if cut is None:
            t = f.get_tensor(name)
        else:
            dim, ranges = cut
            part = f.get_slice(name)
            pieces = [part[a:b] if dim == 0 else part[:, a:b] for a, b in ranges]
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        if t.dtype not in FLOAT_DTYPES and not self.quantized:
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype} (a quantized checkpoint?); "
                             "pdserve loads bf16/fp16/fp32 weights only")
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def resolve_quantization(cfg: ModelConfig, quantization: str, group_size: int) -> tuple[str, int]:
    """The projections' scheme and int4 group size: `quantization` on a float checkpoint; a quantized
    checkpoint's own (int4, its group size: `group_size` is ignored) under `none` or `int4`."""
    if quantization not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}; got {quantization!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}; "
                         f"got {group_size!r}")
    if cfg.quantization is None:
        return quantization, group_size
    if quantization == "int8":
        raise ValueError(f"quantization int8 cannot apply to a 4-bit {cfg.quantization.method} checkpoint "
                         "(it is served int4 as stored): set quantization none or int4")
    q = cfg.num_attention_heads * cfg.head_dim
    return "int4", cfg.quantization.kernel_group_size(cfg.hidden_size, q, cfg.intermediate_size)


def load_model(model_dir: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int, quantization: str = "none", group_size: int = 128,
               plan: QuantPlan | None = None, quantize_lm_head: bool = False, shard: HeadShard | None = None,
               reduce=None) -> LlamaModel:
    """Build the model and copy HF weights into it, fusing q/k/v and gate/up (Phi-3 ships them fused).

    `quantization` int8 / int4 (or a quantized checkpoint): the decoder projections are packed for
    the weight-only kernels under `plan` (default: measured for this machine, kernel_choice.quantized_plan);
    with `quantize_lm_head` the LM head too, round-to-nearest from its float weight (a tied head from
    the embedding, which stays as loaded for lookups).

    `shard` / `reduce`: one rank of a tensor-parallel group (engine/parallel/shard.py): the rank reads its
    slice of each projection from the files, and rank 0 alone the LM head and the row-parallel biases.
    """
    shard = shard or shard_heads(cfg)
    scheme, group_size = resolve_quantization(cfg, quantization, group_size)
    if scheme != "none" and plan is None:
        plan = kernel_choice.quantized_plan(cfg, scheme, group_size, dtype, device)
    quant = plan if scheme != "none" else None
    checkpoint = cfg.quantization
    src = CheckpointTensors(model_dir, quantized=checkpoint is not None,
                            slices=lambda name: weight_slices(name, cfg, shard))
    if cfg.tie_word_embeddings and not _head_is_embedding(src):     # every rank alike: each holds the whole head
        if shard.rank == 0:
            log.warning("%s: config.json ties the LM head to the embedding but lm_head.weight differs from "
                        "model.embed_tokens.weight; serving the stored head untied, as transformers does", model_dir)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions, torch.device("meta"), dtype, quant, quantize_lm_head, shard, reduce)
    model = model.to_empty(device=device)
    model.rope = type(model.rope)(cfg, max_positions, device, dtype)
    if cfg.tie_word_embeddings and isinstance(model.lm_head, Linear):
        model.lm_head.weight = model.embed_tokens.weight
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"{model_dir}: weight {name!r} is missing from the safetensors files")
        taken.add(name)
        return src[name]

    def check(shape: tuple[int, ...], value: torch.Tensor, name: str) -> None:
        if tuple(shape) != tuple(value.shape):
            raise ValueError(f"{model_dir}: weight {name!r} has shape {tuple(value.shape)}, "
                             f"config.json implies {tuple(shape)}")

    def copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        check(param.shape, value, name)
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{model_dir}: tensor {name!r} has dtype {value.dtype}; a float weight was expected")
        param.copy_(value)

    def project(owner: torch.nn.Module, attr: str, parts: list[str], sizes: list[int], name: str) -> None:
        """Fill projection `owner.attr` from checkpoint projections `parts` (fused along the output)."""
        module = getattr(owner, attr)
        packed = [checkpoint is not None and f"{p}.{PACKED_NAME[checkpoint.method]}" in src for p in parts]
        if any(packed) and not all(packed):
            raise ValueError(f"{model_dir}: {', '.join(parts)} are fused into one projection but only some "
                             "are quantized")
        if all(packed):
            weight = concat([read_projection(checkpoint, take, p, module.in_features, size, group_size)
                             for p, size in zip(parts, sizes)])
            module.set_weight(weight, device)
            return
        dense = torch.cat([take(p + ".weight") for p in parts])
        if isinstance(module, QuantizedLinear) and checkpoint is not None:
            module = Linear(module.in_features, module.out_features, module.bias is not None).to(device, dtype)
            setattr(owner, attr, module)         # a projection the checkpoint left unquantized stays dense
        if isinstance(module, QuantizedLinear):
            check((module.out_features, module.in_features), dense, name)
            module.set_weight(quantize(dense, scheme, group_size), device)
        else:
            copy(module.weight, dense, name)

    fused = cfg.model_type == "phi3"
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        copy(model.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        copy(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if model.lm_head is None:        # a tensor-parallel rank other than 0: no head
            pass
        elif isinstance(model.lm_head, QuantizedLinear):
            head = model.embed_tokens.weight if cfg.tie_word_embeddings else take("lm_head.weight")
            check((model.lm_head.out_features, model.lm_head.in_features), head, "lm_head.weight")
            model.lm_head.set_weight(quantize(head, scheme, group_size), device)
        elif not cfg.tie_word_embeddings:
            copy(model.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            if fused:
                project(layer, "qkv_proj", [p + "self_attn.qkv_proj"], [q + 2 * kv], p + "self_attn.qkv_proj.weight")
                project(layer, "gate_up_proj", [p + "mlp.gate_up_proj"], [2 * cfg.intermediate_size],
                        p + "mlp.gate_up_proj.weight")
            else:
                project(layer, "qkv_proj", [p + f"self_attn.{n}_proj" for n in "qkv"], [q, kv, kv],
                        p + "self_attn.qkv_proj.weight")
                project(layer, "gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"],
                        [cfg.intermediate_size] * 2, p + "mlp.gate_up_proj.weight")
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            project(layer, "o_proj", [p + "self_attn.o_proj"], [cfg.hidden_size], p + "self_attn.o_proj.weight")
            if cfg.o_proj_bias:
                copy(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
                layer.o_proj.bias.mul_(shard.rank == 0)      # row-parallel: the all-reduce adds rank 0's once
            project(layer, "down_proj", [p + "mlp.down_proj"], [cfg.hidden_size], p + "mlp.down_proj.weight")
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]))
                layer.down_proj.bias.copy_(take(p + "mlp.down_proj.bias"))
                layer.down_proj.bias.mul_(shard.rank == 0)
            if cfg.qk_norm:
                copy(layer.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                copy(layer.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                copy(getattr(layer, norm).weight, take(p + norm + ".weight"), p + norm + ".weight")
    if checkpoint is not None and not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError(f"{model_dir}: config.json declares a {checkpoint.method} checkpoint but no projection "
                         f"carries {PACKED_NAME[checkpoint.method]!r} tensors")
    unused = [n for n in src if n not in taken and not n.endswith("rotary_emb.inv_freq")
              and not ((cfg.tie_word_embeddings or model.lm_head is None) and n == "lm_head.weight")
              # GPTQ exporters save a zero bias for every projection, biased or not
              and not (checkpoint is not None and n.endswith(".bias") and not src[n].any())]
    if unused:
        raise ValueError(f"{model_dir}: unexpected weights for {cfg.model_type}: {unused[:5]}")
    return model.eval()


def _head_is_embedding(src: CheckpointTensors) -> bool:
    """Whether a tied checkpoint's head is its embedding: no lm_head.weight stored, or one equal to it.
    transformers (PreTrainedModel.tie_weights) unties a head that differs, and serves it as stored."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in src or embed not in src:
        return True
    stored = src[head]
    return torch.equal(stored, src[embed].to(stored.dtype))


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
