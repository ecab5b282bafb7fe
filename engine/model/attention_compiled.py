"""Decode attention read straight through the block table, compiled by Inductor.

The eager decode path copies every sequence's K/V blocks into one contiguous
tensor (`gather_kv`) and then reads that copy again in two bmm calls: at batch
64 with 500-token contexts that is ~1.5 GB of memory traffic a step, more than
the weights. Written as plain broadcast-multiply-reduce over `cache[table]`,
Inductor turns each of the two products into one loop that loads K or V through
the block table as it goes, so the blocks are read once and never copied.

Two graphs serve every batch, both compiled when the engine starts (a few
seconds, cached on disk by Inductor): batch 1, and any larger batch (dynamic
shapes); block tables are padded to at least 2 blocks, since Inductor
specializes a size of 1. Without a working C++ compiler `build` returns None
and the engine stays on the eager path.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.kv_cache.kv_format import FP8_BIT_SCALE, fp8_bits_to_float

log = logging.getLogger(__name__)


def paged_decode(q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, Hkv, g, D]; layer_cache: [NB, 2, Hkv, bs, D]; tables: [B, nb]; bias: [B, nb * bs] float32
    (0, or -inf past a sequence's length) -> [B, Hkv, g, D] in q's dtype. Math in float32."""
    keys = layer_cache[tables, 0].float()                   # [B, nb, Hkv, bs, D] (fused into the loops below)
    values = layer_cache[tables, 1].float()
    return _attend(q, keys, values, bias, scale)


def paged_decode_quantized(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, tables: torch.Tensor,
                           bias: torch.Tensor, scale: float, fp8: bool) -> torch.Tensor:
    """`paged_decode` over a quantized cache (engine.kv_cache.kv_format): data [NB, 2, Hkv, bs, D] int8 (fp8
    values viewed as int8 when `fp8`), scales [NB, 2, Hkv, S] float32 (S = 1 or bs); each row is dequantized
    in the loops that read it (fp8 by bit moves: `fp8_bits_to_float`)."""
    if fp8:
        keys = fp8_bits_to_float(data[tables, 0]) * (scales[tables, 0] * FP8_BIT_SCALE)[..., None]
        values = fp8_bits_to_float(data[tables, 1]) * (scales[tables, 1] * FP8_BIT_SCALE)[..., None]
    else:
        keys = data[tables, 0].float() * scales[tables, 0][..., None]          # [B, nb, Hkv, bs, D]
        values = data[tables, 1].float() * scales[tables, 1][..., None]
    return _attend(q, keys, values, bias, scale)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
            scale: float) -> torch.Tensor:
    """The two products and the softmax over K/V [B, nb, Hkv, bs, D] float32 (still lazy: Inductor fuses
    their loads into these loops)."""
    num_seqs, num_kv_heads, group, dim = q.shape
    width, block_size = keys.shape[1], keys.shape[3]
    scores = (q.float()[:, None, :, :, None, :] * keys[:, :, :, None, :, :]).sum(-1)   # [B, nb, Hkv, g, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group, width * block_size)
    probs = torch.softmax(scores * scale + bias[:, None, None, :], dim=-1)
    probs = probs.view(num_seqs, num_kv_heads, group, width, block_size).permute(0, 3, 1, 2, 4)
    out = (probs[..., None] * values[:, :, :, None, :, :]).sum(dim=(1, 4))          # [B, Hkv, g, D]
    return out.to(q.dtype)


class CompiledDecode:
    """Callable like `engine.model.attention.decode_attention`, but over the cache and block table.

    kv_format: a quantized cache's format (engine.kv_cache.kv_format); None: a model-dtype cache."""

    def __init__(self, kv_format=None) -> None:
        self.kv_format = kv_format if kv_format is not None and kv_format.quantized else None
        self._fn = torch.compile(paged_decode if self.kv_format is None else paged_decode_quantized)

    def __call__(self, q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor,
                 scale: float, mark_dynamic: bool = False) -> torch.Tensor:
        """q: [B, Hq, D] -> [B, Hq, D]; tables at least 2 wide (see `build_metadata`)."""
        num_seqs, num_heads, dim = q.shape
        if self.kv_format is None:
            caches, flags = (layer_cache,), ()
        else:
            data, scales = self.kv_format.split(layer_cache)
            caches, flags = (data.view(torch.int8), scales), (self.kv_format.kind == "fp8",)
        num_kv_heads = caches[0].shape[2]
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, dim)
        if mark_dynamic:   # at compile time only: batch, table width and pool size symbolic; heads,
            #                group, block size and head dim static (specialized, vectorized code)
            for tensor, dims in ((qg, (0,)), (tables, (0, 1)), (bias, (0, 1)), *((c, (0,)) for c in caches)):
                for axis in dims:
                    torch._dynamo.maybe_mark_dynamic(tensor, axis)
        return self._fn(qg, *caches, tables, bias, scale, *flags).reshape(num_seqs, num_heads, dim)

    def warm_up(self, layer_cache: torch.Tensor, num_heads: int) -> None:
        """Compile now (not on the first request) and check against the eager math.

        Two graphs: batch >= 2 (symbolic) and batch 1 (Inductor specializes size 1)."""
        from engine.model.attention import decode_attention, gather_kv
        gen = torch.Generator().manual_seed(0)
        fmt = self.kv_format
        if fmt is None:
            _, _, num_kv_heads, block_size, dim = layer_cache.shape
            cache = torch.randn(8, 2, num_kv_heads, block_size, dim, generator=gen).to(layer_cache)
            dtype = layer_cache.dtype
        else:
            block_size, dim, dtype = fmt.block_size, fmt.head_dim, fmt.dtype
            cache = torch.zeros(8, fmt.cell_bytes, dtype=torch.uint8, device=layer_cache.device)
            kv = torch.randn(8 * block_size, 2, fmt.num_kv_heads, dim, generator=gen).to(layer_cache.device, dtype)
            rows = torch.arange(8 * block_size, device=layer_cache.device)
            fmt.write(cache, kv[:, 0], kv[:, 1], rows // block_size, rows % block_size)
        for num_seqs, width in ((5, 2), (1, 3)):
            tables = torch.randint(0, cache.shape[0], (num_seqs, width), generator=gen).to(layer_cache.device)
            bias = torch.zeros(num_seqs, width * block_size, device=layer_cache.device)
            bias[:, -block_size // 2:] = float("-inf")
            # as in a model step: q made in inference mode, cache/tables/bias outside it (same guards)
            with torch.inference_mode():
                q = torch.randn(num_seqs, num_heads, dim, generator=gen).to(layer_cache.device, dtype)
                got = self(q, cache, tables, bias, dim ** -0.5, mark_dynamic=True)
            want = decode_attention(q, gather_kv(cache, tables, fmt), bias, dim ** -0.5)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                raise RuntimeError("compiled decode attention disagrees with the eager path")


def build(layer_cache: torch.Tensor, num_heads: int, kv_format=None) -> CompiledDecode | None:
    """A compiled, checked decode kernel for this cache, or None (no compiler, unsupported device)."""
    start = time.perf_counter()
    try:
        kernel = CompiledDecode(kv_format)
        kernel.warm_up(layer_cache, num_heads)
    except Exception as exc:           # no C++ compiler, Inductor limitation: eager is always correct
        log.warning("compiled decode attention unavailable (%s: %s); using the eager path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("compiled decode attention ready in %.1f s", time.perf_counter() - start)
    return kernel
