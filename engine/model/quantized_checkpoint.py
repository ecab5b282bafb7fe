"""Quantized checkpoints: which `quantization_config` formats load, and their tensors as `QuantizedWeight`s.

Accepted (every one reaches the int4 path of engine/model/quantized_linear.py, weight-only):

    gptq                  bits 4, desc_act false (no act-order), checkpoint_format gptq or gptq_v2;
                          qweight int32 [K/8, N] (8 codes along the input per word, low nibble first),
                          qzeros int32 [G, N/8] (along the output; format gptq stores zero - 1),
                          scales [G, N], g_idx [K] (must be k // group_size)
    awq                   bits 4, version gemm, zero_point true; qweight int32 [K, N/8] and qzeros
                          [G, N/8] along the output in AWQ's interleaved order (word nibble i holds
                          output 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]), scales [G, N]
    compressed-tensors    format pack-quantized, one config group of int weights, num_bits 4,
                          symmetric, strategy group or channel, no act-order, no activation
                          quantization; weight_packed int32 [N, K/8] (codes + 8, low nibble first),
                          weight_scale [N, G], weight_shape [2]

In each, w = (q - z) * s per group of `group_size` input channels (z = 8 when symmetric). A group size
of 256, or per channel (-1 / strategy channel), is served as groups of 128 (or 64, 32: the largest
the input dimension takes) with each scale repeated: the same weights. Projections a checkpoint
leaves unquantized (`modules_to_not_convert`, `ignore`) load dense. Everything else (other bit
widths, act-order, fp8 weights, bitsandbytes, activation quantization, ...) is refused with an error
naming the field or the format.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.quantization import GROUP_SIZES, INT4_OFFSET, QuantizedWeight

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # output column 8j + AWQ_ORDER[i] sits in nibble i of word j
# The tensor a quantized projection carries instead of `.weight`, per method.
PACKED_NAME = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
# Tensor-name endings of quantized checkpoints; a checkpoint without a supported quantization_config
# that holds one is refused (engine/model/loader.py).
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                      ".weight_packed", ".weight_shape", ".weight_zero_point", ".weight_g_idx",
                      ".input_scale", ".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
                      ".quant_state.bitsandbytes__fp4", ".SCB")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """A checkpoint's accepted `quantization_config`."""

    method: str                 # gptq | awq | compressed-tensors
    group_size: int             # the checkpoint's own (the input dimension for per-channel: -1)
    zero_offset: int = 0        # GPTQ format gptq stores zero points less one

    def kernel_group_size(self, *in_features: int) -> int:
        """The int4 group this checkpoint is served with: the largest of GROUP_SIZES that divides its
        own group and every projection's input features (`in_features`)."""
        fits = [g for g in GROUP_SIZES if all(k % g == 0 and (self.group_size == -1 or self.group_size % g == 0)
                                              for k in in_features)]
        if not fits:
            raise ValueError(f"{self.method} group_size {self.group_size} with input features {in_features} maps "
                             f"onto none of the int4 groups {GROUP_SIZES}")
        return max(fits)


def _refuse(source: str, found: object, why: str) -> ValueError:
    return ValueError(f"{source}: quantized checkpoint (quantization_config {found!r}) is not supported: {why}")


def parse_quantization_config(raw: dict, source: str = "config.json") -> CheckpointQuantization | None:
    """The checkpoint's quantization (None: a float checkpoint); anything pdserve cannot serve raises
    ValueError naming the field or the format."""
    quant = raw.get("quantization_config") or raw.get("compression_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise _refuse(source, quant, "quantization_config must be an object")
    method = str(quant.get("quant_method", quant.get("quant_type", ""))).lower()
    shown = {k: quant[k] for k in ("quant_method", "quant_type", "load_in_4bit", "load_in_8bit", "bits", "format")
             if k in quant} or quant
    if method == "gptq":
        return _gptq(quant, shown, source)
    if method == "awq":
        return _awq(quant, shown, source)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, shown, source)
    if method in ("fp8", "fbgemm_fp8", "fp_quant"):
        raise _refuse(source, shown, f"quant_method {method!r} stores fp8 weights, which do not map onto pdserve's "
                      "int8 / int4 weight-only kernels (accepted: gptq, awq, compressed-tensors pack-quantized 4-bit)")
    raise _refuse(source, shown, f"quant_method {method or None!r} (accepted: gptq, awq, compressed-tensors "
                  "pack-quantized 4-bit; or model.quantization int8 / int4 on a float checkpoint)")


def _bits(quant: dict, shown, source: str, *names: str) -> None:
    bits = next((quant[n] for n in names if n in quant), 4)
    if bits != 4:
        raise _refuse(source, shown, f"field {names[0]!r} is {bits!r}; pdserve loads 4-bit checkpoints only")


def _group(quant: dict, shown, source: str, *names: str) -> int:
    group = next((quant[n] for n in names if n in quant), 128)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0 and group % 32 == 0):
        raise _refuse(source, shown, f"field {names[0]!r} is {group!r}; it must be -1 (per channel) or a "
                      "multiple of 32")
    return group


def _gptq(quant: dict, shown, source: str) -> CheckpointQuantization:
    _bits(quant, shown, source, "bits")
    group = _group(quant, shown, source, "group_size")
    if quant.get("desc_act"):
        raise _refuse(source, shown, "field 'desc_act' is true (act-order): its permuted groups need g_idx "
                      "kernels pdserve does not have; re-quantize with desc_act false")
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(source, shown, f"field 'checkpoint_format' is {fmt!r} (accepted: gptq, gptq_v2)")
    return CheckpointQuantization("gptq", group, zero_offset=1 if fmt == "gptq" else 0)


def _awq(quant: dict, shown, source: str) -> CheckpointQuantization:
    _bits(quant, shown, source, "bits", "w_bit")
    group = _group(quant, shown, source, "group_size", "q_group_size")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(source, shown, f"field 'version' is {version!r}; pdserve reads AWQ's gemm packing only")
    if not quant.get("zero_point", True):
        raise _refuse(source, shown, "field 'zero_point' is false; pdserve reads AWQ with zero points only")
    return CheckpointQuantization("awq", group)


def _compressed_tensors(quant: dict, shown, source: str) -> CheckpointQuantization:
    fmt = quant.get("format")
    if fmt != "pack-quantized":
        raise _refuse(source, shown, f"compressed-tensors format {fmt!r} does not map onto pdserve's int4 path "
                      "(accepted: pack-quantized 4-bit integer weights; float-quantized / fp8, int-quantized "
                      "and sparse formats are not)")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(source, shown, f"field 'config_groups' has {len(groups)} groups; pdserve reads one")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise _refuse(source, shown, "activation quantization (config_groups.*.input_activations) is not "
                      "supported; pdserve quantizes weights only")
    checks = (("type", "int"), ("num_bits", 4), ("symmetric", True))
    for key, want in checks:
        if weights.get(key, want) != want:
            raise _refuse(source, shown, f"field 'config_groups.*.weights.{key}' is {weights.get(key)!r} "
                          f"(pdserve reads {want!r})")
    if weights.get("actorder"):
        raise _refuse(source, shown, "field 'config_groups.*.weights.actorder' is set (act-order); "
                      "pdserve reads actorder null only")
    strategy = weights.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise _refuse(source, shown, f"field 'config_groups.*.weights.strategy' is {strategy!r} "
                      "(accepted: group, channel)")
    group = -1 if strategy == "channel" else _group(weights, shown, source, "group_size")
    return CheckpointQuantization("compressed-tensors", group)


# ---- tensors ------------------------------------------------------------------------------------
def _unpack_words(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words → 4-bit codes, 8 per word along `dim` (nibble i is element 8j + order[i])."""
    words = words.to(torch.int32)
    parts = [(words >> (4 * i)) & 15 for i in range(8)]
    codes = torch.stack([parts[order.index(e)] for e in range(8)], dim=dim + 1)    # element e of each word
    shape = list(words.shape)
    shape[dim] *= 8
    return codes.reshape(shape).to(torch.uint8)


def read_projection(fmt: CheckpointQuantization, take: Callable[[str], torch.Tensor], prefix: str,
                    in_features: int, out_features: int, group: int) -> QuantizedWeight:
    """The int4 weight of projection `prefix` (e.g. `model.layers.0.self_attn.q_proj`) from its tensors,
    in groups of `group` (`fmt.kernel_group_size`). `take(name)` returns a tensor and marks it used."""
    own = in_features if fmt.group_size == -1 else fmt.group_size
    n, k = out_features, in_features

    def shaped(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = take(f"{prefix}.{name}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{fmt.method} tensor {prefix}.{name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t
    groups = -(-k // own)
    if fmt.method == "compressed-tensors":
        stored = shaped("weight_shape", (2,))
        if stored.tolist() != [n, k]:
            raise ValueError(f"compressed-tensors {prefix}.weight_shape is {stored.tolist()}, expected {[n, k]}")
        codes = _unpack_words(shaped("weight_packed", (n, k // 8)), dim=1)                       # [N, K]
        scales = shaped("weight_scale", (n, groups)).float()                                     # [N, G]
        zero = torch.full_like(scales, INT4_OFFSET)
    else:
        order = AWQ_ORDER if fmt.method == "awq" else tuple(range(8))
        if fmt.method == "gptq":
            codes = _unpack_words(shaped("qweight", (k // 8, n)), dim=0).t()                     # [N, K]
            g_idx = f"{prefix}.g_idx"
            try:
                idx = take(g_idx)
            except KeyError:
                idx = None
            if idx is not None and not torch.equal(idx.long(), torch.arange(k) // own):
                raise ValueError(f"gptq tensor {g_idx!r} is not k // group_size (act-order groups); pdserve "
                                 "reads desc_act false checkpoints only")
        else:
            codes = _unpack_words(shaped("qweight", (k, n // 8)), dim=1, order=order).t()        # [N, K]
        zero = _unpack_words(shaped("qzeros", (groups, n // 8)), dim=1, order=order).t().float() + fmt.zero_offset
        scales = shaped("scales", (groups, n)).float().t()                                       # [N, G]
    zeros = (INT4_OFFSET - zero) * scales                      # (q - z) s = (q - 8) s + (8 - z) s
    repeat = own // group
    return QuantizedWeight("int4", codes.contiguous(), scales.repeat_interleave(repeat, dim=1).contiguous(),
                           zeros.repeat_interleave(repeat, dim=1).contiguous(), group)
