"""How a projection's weight is stored and multiplied on this machine.

Every projection of the decoder (q/k/v, o, gate/up, down, lm_head) is a `Linear`; its weight lives in
one of these layouts, chosen once per machine by `engine.model.kernel_choice.weight_layout`:

    row-major       [out, in] as loaded; F.linear hands BLAS a transposed GEMM
    input-major     the same [out, in] tensor, [in, out] in memory; BLAS gets a plain GEMM
                    (a batch-1 float32 GEMV reads it ~10-40% faster on AMD EPYC and Intel Xeon hosts)
    onednn-packed   oneDNN's blocked copy of the weight (the dense one is freed), multiplied by
                    oneDNN's inner-product kernel. MKL's GEMM packs the weight again on every call,
                    which is most of the time of a GEMM with few rows: a decode step of 8 sequences
                    ran 1.7x faster packed on an AVX2 EPYC, a 2048-row prefill 1.06x. Its 1-row
                    GEMV is slower than BLAS's (1.4x the time there).
    onednn-packed+input-major
                    float32: both copies, the packed one for products of 2 rows or more, the
                    input-major one for 1-row GEMVs (a decode step of one sequence, a prompt's
                    last-row logits); twice the weights' memory

Products of 2 rows or more go through one kernel in a given layout, so prefill and decode agree. The
layouts give float32 results that differ in the last bits, so every process of a machine must choose
the same one (kernel_choice keys its cache by machine, not by process).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

ROW_MAJOR, INPUT_MAJOR, ONEDNN_PACKED = "row-major", "input-major", "onednn-packed"
PACKED_WITH_GEMV = "onednn-packed+input-major"
LAYOUTS = (ROW_MAJOR, INPUT_MAJOR, ONEDNN_PACKED, PACKED_WITH_GEMV)
PACK_ROWS_HINT = 32     # the row count oneDNN tunes its blocked layout for (any row count runs on it)


def layouts_for(weight: torch.Tensor) -> tuple[str, ...]:
    """The layouts this weight can be stored in: only CPU float32 and bfloat16 have a choice.

    Input-major is float32 only (oneDNN's bf16 kernels read row-major weights 2x faster); packing
    needs oneDNN and, for bf16, a CPU oneDNN packs bf16 for (AVX-512 or AVX-NE-CONVERT)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return (ROW_MAJOR,)
    if weight.dtype == torch.bfloat16:
        return (ROW_MAJOR, ONEDNN_PACKED) if packs(weight.dtype) else (ROW_MAJOR,)
    return (ROW_MAJOR, INPUT_MAJOR) + ((ONEDNN_PACKED, PACKED_WITH_GEMV) if packs(weight.dtype) else ())


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Can oneDNN pack a `dtype` weight on this CPU (tried on a tiny one)?"""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), PACK_ROWS_HINT)
    except RuntimeError:
        return False
    return True


def relayout(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """`weight` ([out, in], dense) stored in `layout`; a packed weight is an opaque oneDNN tensor."""
    if layout == ROW_MAJOR:
        return weight.contiguous()
    if layout == INPUT_MAJOR:
        return weight.t().contiguous().t()
    if layout == ONEDNN_PACKED:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
    raise ValueError(f"unknown weight layout {layout!r}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for a weight in any layout (`relayout`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose weight may be stored packed for oneDNN (`packed`); the dense weight is then
    freed, or kept input-major for products of up to `dense_rows` rows (`PACKED_WITH_GEMV`: 1 row, or
    the crossover `kernel_choice.dense_rows` measured, e.g. a speculative step's few rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.packed: torch.Tensor | None = None
        self.dense_rows = 1

    @property
    def layout(self) -> str:
        w = self.weight
        input_major = w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous()
        if self.packed is not None:
            return PACKED_WITH_GEMV if w.numel() else ONEDNN_PACKED
        return INPUT_MAJOR if input_major else ROW_MAJOR

    def store(self, layout: str) -> None:
        """Keep the weight in `layout` (from the dense one: call once, before any packing)."""
        if self.packed is not None:
            raise RuntimeError("the weight is already packed; its dense copy is gone or fixed")
        with torch.no_grad():
            if layout in (ONEDNN_PACKED, PACKED_WITH_GEMV):
                self.packed = relayout(self.weight, ONEDNN_PACKED)
                dense = relayout(self.weight.data, INPUT_MAJOR) if layout == PACKED_WITH_GEMV else None
                self.weight.data = dense if dense is not None else self.weight.data.new_empty(0)
            else:
                self.weight.data = relayout(self.weight.data, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (x.numel() <= self.dense_rows * x.shape[-1] and self.weight.numel()):
            return F.linear(x, self.weight, self.bias)     # dense, or few rows with a dense copy kept
        return linear(x, self.packed, self.bias)
