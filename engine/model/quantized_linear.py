"""A decoder projection whose weight is stored int8 or int4 (weight-only) and multiplied by kernels
that read the packed weight.

    int8, CPU    torch.ops.aten._weight_int8pack_mm: int8 [N, K] codes, one scale per output channel
    int4, CPU    torch.ops.aten._weight_int4pack_mm_for_cpu on _convert_weight_to_int4pack_for_cpu's
                 layout (uint8 [N, K/2]); scales and float zeros [K/group, N, 2], as gpt-fast and torchao
    int4, CUDA   torch.ops.aten._weight_int4pack_mm (tinygemm) on _convert_weight_to_int4pack's layout
    int8, CUDA   no packed kernel: the dense path below, reading the int8 codes (gpt-fast's form)

The packed kernels are GEMVs at heart: fast for a few rows (a decode step), slow for many (on this
project's Xeon a 512-row product ran 6x slower than dequantize + matmul). So a `QuantPlan`, measured
per machine and shape (engine/model/kernel_choice.py `quantized_plan`), sends products of at most
`max_kernel_rows` rows to the packed kernel and larger ones (prefill) to the dense path: the weight is
dequantized into one scratch buffer the model's projections share, then one GEMM. Both read the
same scales and codes, so they multiply by the same weight; they round activations differently when
their dtypes differ (`kernel_dtype`, `dense_dtype`: on CPU torch vectorizes these kernels for
bfloat16 only, so a float32 model's quantized projections may compute in bfloat16 where that
measured faster), so logits depend on the batch's row count in the last bits, as with the
`onednn-packed+input-major` weight layout.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.quantization import INT4_OFFSET, QuantizedWeight, check_shape

log = logging.getLogger(__name__)
INT4_ROWS = 16                    # the int4 kernels take a multiple of 16 output channels: pad to it


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """How a model's quantized projections are stored and multiplied on this machine."""

    scheme: str                   # "int8" | "int4"
    group_size: int               # int4: input channels per scale (int8: ignored, per output channel)
    kernel_dtype: torch.dtype     # activations and scales of the packed kernel
    dense_dtype: torch.dtype      # the dequantized weight and activations of the dense path
    max_kernel_rows: int          # products of at most this many rows take the packed kernel

    def __str__(self) -> str:
        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")
        group = f" group {self.group_size}" if self.scheme == "int4" else ""
        return (f"{self.scheme}{group}: packed kernel ({name(self.kernel_dtype)}) up to {self.max_kernel_rows} rows, "
                f"dequantize + GEMM ({name(self.dense_dtype)}) above")


class DenseScratch:
    """The buffer a model's quantized projections dequantize into, one at a time (the engine runs one
    forward at a time): the dense path then allocates and page-faults nothing per call."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W int8 or int4 packed for its kernel (module docstring); `set_weight` fills it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, plan: QuantPlan,
                 scratch: DenseScratch | None = None):
        super().__init__()
        check_shape(plan.scheme, plan.group_size, out_features, in_features)
        self.in_features, self.out_features, self.plan = in_features, out_features, plan
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scratch = scratch or DenseScratch()
        self.rows = out_features if plan.scheme == "int8" else -(-out_features // INT4_ROWS) * INT4_ROWS
        self.packed: torch.Tensor | None = None          # int8 codes [N, K] | int4 packed (kernel layout)
        self.scale_zeros: torch.Tensor | None = None     # int8: scales [N]; int4: [K/group, rows, 2]
        self.dense_affine: tuple[torch.Tensor, ...] = ()  # int4, dense path: scales, zeros - 8 * scales [K/group, rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.plan}"

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (codes + scales/zeros): what a decode step reads."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros) if t is not None)

    # ---- loading -----------------------------------------------------------------------------
    def set_weight(self, weight: QuantizedWeight, device: torch.device | None = None) -> None:
        """Pack `weight` ([out, in], this plan's scheme; int4 with this plan's group size) for the kernel."""
        p = self.plan
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight has shape {weight.shape}, the projection is "
                             f"{(self.out_features, self.in_features)}")
        if weight.scheme != p.scheme or (p.scheme == "int4" and weight.group_size != p.group_size):
            raise ValueError(f"a {weight.scheme} weight (group {weight.group_size}) cannot fill a {p.scheme} "
                             f"projection (group {p.group_size})")
        device = device or (self.bias.device if self.bias is not None else torch.device("cpu"))
        codes = weight.codes.to(device)
        if p.scheme == "int8":
            self.packed = codes.contiguous()
            self.scale_zeros = weight.scales[:, 0].to(device, p.kernel_dtype).contiguous()
            return
        pad = self.rows - self.out_features         # zero rows: their outputs are dropped
        scales, zeros = F.pad(weight.scales, (0, 0, 0, pad)), F.pad(weight.zeros, (0, 0, 0, pad))
        codes = F.pad(codes, (0, 0, 0, pad), value=INT4_OFFSET)
        # [K/group, rows, 2]: scale and zero of group g of output channel n
        self.scale_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(device, p.kernel_dtype).contiguous()
        stored = self.scale_zeros.float()
        self.dense_affine = tuple(t.to(p.dense_dtype).contiguous()
                                  for t in (stored[..., 0], stored[..., 1] - INT4_OFFSET * stored[..., 0]))
        if device.type == "cuda":
            nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(),
                                                                     _inner_k_tiles(self.in_features))
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)

    # ---- the two paths -----------------------------------------------------------------------
    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through the packed kernel (in the plan's kernel dtype; returned in it)."""
        p = self.plan
        x = x.to(p.kernel_dtype).contiguous()
        if p.scheme == "int8":
            if self.packed.device.type == "cuda":       # no int8 packed kernel on CUDA: int8 codes in the GEMM
                return F.linear(x, self.packed.to(x.dtype)) * self.scale_zeros
            return torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scale_zeros)
        if self.packed.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, p.group_size, self.scale_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, p.group_size, self.scale_zeros)
        return y if self.rows == self.out_features else y[:, :self.out_features].contiguous()

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`, dequantized from the packed one into the shared scratch buffer
        (int4: the transpose of an input-major [K, N] buffer, which unpacks in contiguous runs)."""
        n, k, device = self.out_features, self.in_features, self.packed.device
        buf = self.scratch.get(self.rows * k, dtype, device)
        if self.plan.scheme == "int8":
            out = buf.view(n, k)
            return torch.mul(self.packed, self.scale_zeros[:, None].to(dtype), out=out)
        out = buf.view(k, self.rows)                                                    # W.T
        if device.type == "cuda" or not cpu_int4_layout_known(self.rows):
            # W.T = I @ W.T through the kernel itself (torchao's way to dequantize the tinygemm layout)
            eye = torch.eye(k, dtype=self.plan.kernel_dtype, device=device)
            fn = torch.ops.aten._weight_int4pack_mm if device.type == "cuda" else \
                torch.ops.aten._weight_int4pack_mm_for_cpu
            out.copy_(fn(eye, self.packed, self.plan.group_size, self.scale_zeros))
            return out[:, :n].t()
        unpack_int4_cpu(self.packed, self.rows, k, out)
        groups = out.view(k // self.plan.group_size, self.plan.group_size, self.rows)
        scales, zeros = (t if t.dtype == dtype else t.to(dtype) for t in self.dense_affine)          # [G, rows]
        torch.addcmul(zeros[:, None], groups, scales[:, None], out=groups)                     # q * s + z - 8 s
        return out[:, :n].t()

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]: dequantize, then one GEMM in the plan's dense dtype (returned in it)."""
        dtype = self.plan.dense_dtype
        return F.linear(x.to(dtype), self.dense_weight(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                                     # [M, K]
        y = self.kernel(x2) if x2.shape[0] <= self.plan.max_kernel_rows else self.dense(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


def _inner_k_tiles(in_features: int) -> int:
    """tinygemm's K tiling (CUDA): the largest of 8, 4, 2 whose tile (16 · tiles) divides K."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def unpack_int4_cpu(packed: torch.Tensor, rows: int, k: int, out: torch.Tensor,
                    block: int | None = None) -> torch.Tensor:
    """Codes as W.T [K, rows] (into `out`, any dtype) from `_convert_weight_to_int4pack_for_cpu`'s
    layout: each block of B output channels is [K, B / 2] bytes, channel j in the low nibbles and j + B / 2
    in the high; the last rows % B channels are [K, (rows % B) / 2] bytes, channel 2j low and 2j + 1 high.
    B is 64 where torch's kernel was built for AVX-512 and 32 for AVX2 (`block`, default: this torch's, as
    `cpu_int4_block` finds it; `cpu_int4_layout_known` checks the layout against the running packer)."""
    block = block or cpu_int4_block() or 64
    half = block // 2
    flat = packed.reshape(-1)
    full = rows // block * block
    if full:
        v = flat[:full * k // 2].view(full // block, k, half).transpose(0, 1)      # [K, blocks, B / 2]
        o = out[:, :full].view(k, full // block, 2, half)
        o[:, :, 0].copy_(v & 15)
        o[:, :, 1].copy_(v >> 4)
    rest = rows - full
    if rest:
        v = flat[full * k // 2:].view(k, rest // 2)
        o = out[:, full:rows].view(k, rest // 2, 2)
        o[..., 0].copy_(v & 15)
        o[..., 1].copy_(v >> 4)
    return out


def _round_trips(rows: int, block: int) -> bool:
    """Does `unpack_int4_cpu` with `block` read back codes of `rows` channels as this torch packs them?"""
    gen = torch.Generator().manual_seed(0)
    k = 64
    codes = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed.shape == (rows, k // 2) and torch.equal(
        unpack_int4_cpu(packed, rows, k, torch.empty(k, rows, dtype=torch.int32), block).t(), codes)


@functools.cache
def cpu_int4_block() -> int | None:
    """The channel block of this torch's CPU int4 packing (64: AVX-512 kernels, 32: AVX2), or None when it packs
    in a layout `unpack_int4_cpu` does not know."""
    return next((block for block in (64, 32) if _round_trips(2 * 64 + 48, block)), None)


@functools.cache
def _layout_known(tail: int) -> bool:
    ok = cpu_int4_block() is not None and _round_trips(128 + tail, cpu_int4_block())
    if not ok:
        log.warning("torch %s packs int4 weights in a layout pdserve does not know; many-row products "
                    "dequantize through the kernel (slow)", torch.__version__)
    return ok


def cpu_int4_layout_known(rows: int) -> bool:
    """Does `unpack_int4_cpu` read this torch's CPU int4 layout (checked once per tail size)?"""
    return _layout_known(rows % 64)
