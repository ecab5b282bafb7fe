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

log = logging.getLogger(__name__)


def paged_decode(q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, Hkv, g, D]; layer_cache: [NB, 2, Hkv, bs, D]; tables: [B, nb]; bias: [B, nb * bs] float32
    (0, or -inf past a sequence's length) -> [B, Hkv, g, D] in q's dtype. Math in float32."""
    num_seqs, num_kv_heads, group, dim = q.shape
    width, block_size = tables.shape[1], layer_cache.shape[3]
    keys = layer_cache[tables, 0].float()                   # [B, nb, Hkv, bs, D] (fused into the loops below)
    values = layer_cache[tables, 1].float()
    scores = (q.float()[:, None, :, :, None, :] * keys[:, :, :, None, :, :]).sum(-1)   # [B, nb, Hkv, g, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group, width * block_size)
    probs = torch.softmax(scores * scale + bias[:, None, None, :], dim=-1)
    probs = probs.view(num_seqs, num_kv_heads, group, width, block_size).permute(0, 3, 1, 2, 4)
    out = (probs[..., None] * values[:, :, :, None, :, :]).sum(dim=(1, 4))          # [B, Hkv, g, D]
    return out.to(q.dtype)


class CompiledDecode:
    """Callable like `engine.model.attention.decode_attention`, but over the cache and block table."""

    def __init__(self) -> None:
        self._fn = torch.compile(paged_decode)

    def __call__(self, q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor,
                 scale: float, mark_dynamic: bool = False) -> torch.Tensor:
        """q: [B, Hq, D] -> [B, Hq, D]; tables at least 2 wide (see `build_metadata`)."""
        num_seqs, num_heads, dim = q.shape
        num_kv_heads = layer_cache.shape[2]
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, dim)
        if mark_dynamic:   # at compile time only: batch, table width and pool size symbolic; heads,
            #                group, block size and head dim static (specialized, vectorized code)
            for tensor, dims in ((qg, (0,)), (tables, (0, 1)), (bias, (0, 1)), (layer_cache, (0,))):
                for axis in dims:
                    torch._dynamo.maybe_mark_dynamic(tensor, axis)
        return self._fn(qg, layer_cache, tables, bias, scale).reshape(num_seqs, num_heads, dim)

    def warm_up(self, layer_cache: torch.Tensor, num_heads: int) -> None:
        """Compile now (not on the first request) and check against the eager math.

        Two graphs: batch >= 2 (symbolic) and batch 1 (Inductor specializes size 1)."""
        from engine.model.attention import decode_attention, gather_kv
        gen = torch.Generator().manual_seed(0)
        _, _, num_kv_heads, block_size, dim = layer_cache.shape
        cache = torch.randn(8, 2, num_kv_heads, block_size, dim, generator=gen).to(layer_cache)
        for num_seqs, width in ((5, 2), (1, 3)):
            tables = torch.randint(0, cache.shape[0], (num_seqs, width), generator=gen).to(layer_cache.device)
            bias = torch.zeros(num_seqs, width * block_size, device=layer_cache.device)
            bias[:, -block_size // 2:] = float("-inf")
            # as in a model step: q made in inference mode, cache/tables/bias outside it (same guards)
            with torch.inference_mode():
                q = torch.randn(num_seqs, num_heads, dim, generator=gen).to(layer_cache)
                got = self(q, cache, tables, bias, dim ** -0.5, mark_dynamic=True)
            want = decode_attention(q, gather_kv(cache, tables), bias, dim ** -0.5)
            tol = 1e-4 if layer_cache.dtype == torch.float32 else 2e-2
            if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                raise RuntimeError("compiled decode attention disagrees with the eager path")


def build(layer_cache: torch.Tensor, num_heads: int) -> CompiledDecode | None:
    """A compiled, checked decode kernel for this cache, or None (no compiler, unsupported device)."""
    start = time.perf_counter()
    try:
        kernel = CompiledDecode()
        kernel.warm_up(layer_cache, num_heads)
    except Exception as exc:           # no C++ compiler, Inductor limitation: eager is always correct
        log.warning("compiled decode attention unavailable (%s: %s); using the eager path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("compiled decode attention ready in %.1f s", time.perf_counter() - start)
    return kernel
