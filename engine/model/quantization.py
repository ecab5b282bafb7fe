"""Weight-only quantization of a projection: integer codes and the affine map back to weights.

A `QuantizedWeight` is the form every source reaches before packing for a kernel
(engine/model/quantized_linear.py): round-to-nearest at load (`quantize`) and the GPTQ / AWQ /
compressed-tensors checkpoint readers (engine/model/quantized_checkpoint.py) alike.

    int8    w[n, k] = codes[n, k] * scales[n, 0]                       codes int8 in -127..127,
                                                                       one scale per output channel
    int4    w[n, k] = (codes[n, k] - 8) * scales[n, g] + zeros[n, g]   codes uint8 in 0..15, g = k // group_size

int4's zero is a float (the kernels' form, as in gpt-fast and torchao's tinygemm layout): an integer
zero point z of GPTQ / AWQ becomes zeros = (8 - z) * scales, and round-to-nearest here is symmetric
(zeros = 0). Round-to-nearest scales are rounded to bfloat16 first (so packing them for a bfloat16
kernel loses nothing) and the codes computed from the rounded scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)         # int4 groups the CPU and CUDA kernels take (and `model.quantization_group_size`)
INT4_OFFSET = 8


@dataclass(slots=True)
class QuantizedWeight:
    """One projection's weight [out_features, in_features] as codes, scales and zeros (module docstring)."""

    scheme: str                       # "int8" | "int4"
    codes: torch.Tensor               # [N, K]: int8 (int8) or uint8 in 0..15 (int4)
    scales: torch.Tensor              # [N, G] float32; G = 1 for int8
    zeros: torch.Tensor | None        # [N, G] float32 for int4, None for int8
    group_size: int                   # K for int8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, [N, K] in `dtype` (computed in float32): the reference."""
        n, k = self.codes.shape
        if self.scheme == "int8":
            return (self.codes.float() * self.scales).to(dtype)
        groups = k // self.group_size
        q = self.codes.float().view(n, groups, self.group_size) - INT4_OFFSET
        return (q * self.scales[..., None] + self.zeros[..., None]).view(n, k).to(dtype)


def check_shape(scheme: str, group_size: int, out_features: int, in_features: int, name: str = "weight") -> None:
    """The kernels' constraint on a projection's shape (int4: whole groups along the input)."""
    if scheme == "int4" and in_features % group_size:
        raise ValueError(f"{name}: int4 needs in_features ({in_features}) to be a multiple of "
                         f"quantization_group_size ({group_size}); choose one of "
                         f"{', '.join(str(g) for g in GROUP_SIZES if in_features % g == 0) or 'none fits'}")


def _bf16_scale(amax: torch.Tensor, levels: int) -> torch.Tensor:
    scale = (amax.float() / levels).to(torch.bfloat16).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))      # an all-zero row or group: codes 0


def quantize(weight: torch.Tensor, scheme: str, group_size: int = 128) -> QuantizedWeight:
    """Round-to-nearest, symmetric: int8 per output channel (scale amax/127), int4 per group of
    `group_size` along the input (scale amax/7, codes 1..15 around 8). weight: [N, K] float."""
    w = weight.detach().float()
    n, k = w.shape
    if scheme == "int8":
        scales = _bf16_scale(w.abs().amax(dim=1, keepdim=True), 127)                  # [N, 1]
        codes = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", codes, scales, None, k)
    if scheme != "int4":
        raise ValueError(f"quantization must be one of int8, int4; got {scheme!r}")
    check_shape(scheme, group_size, n, k)
    groups = w.view(n, k // group_size, group_size)
    scales = _bf16_scale(groups.abs().amax(dim=2), 7)                                  # [N, G]
    codes = (torch.round(groups / scales[..., None]).clamp_(-7, 7) + INT4_OFFSET).to(torch.uint8).view(n, k)
    return QuantizedWeight("int4", codes, scales, torch.zeros_like(scales), group_size)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights stacked along the output (q, k, v into qkv; gate, up into gate_up): scales are per
    output channel, so they stack with their rows."""
    first = parts[0]
    if any(p.scheme != first.scheme or p.group_size != first.group_size for p in parts):
        raise ValueError("fused projections must share one quantization scheme and group size "
                         f"(got {[(p.scheme, p.group_size) for p in parts]})")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(first.scheme, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           zeros, first.group_size)


def regroup(weight: QuantizedWeight, group_size: int) -> QuantizedWeight:
    """The same weight with groups of `group_size` (a divisor of its own): each scale and zero repeats."""
    if weight.group_size == group_size:
        return weight
    assert weight.group_size % group_size == 0, (weight.group_size, group_size)
    repeat = weight.group_size // group_size
    zeros = None if weight.zeros is None else weight.zeros.repeat_interleave(repeat, dim=1)
    return QuantizedWeight(weight.scheme, weight.codes, weight.scales.repeat_interleave(repeat, dim=1), zeros,
                           group_size)
