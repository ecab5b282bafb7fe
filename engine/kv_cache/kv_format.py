"""How the paged KV cache stores K and V: in the model dtype, or quantized to one byte with float32 scales.

`kv_cache.dtype: auto` keeps the model dtype:

    kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]   (model dtype)

`fp8` and `int8` store each (layer, block) as one cell of bytes, data first, then its scales:

    kv_cache: [num_layers, num_blocks, cell_bytes]   uint8
    cell    = data   [2, num_kv_heads, block_size, head_dim]   float8_e4m3fn | int8
              scales [2, num_kv_heads, S]                       float32

    fp8   S = 1: one scale per block × layer × K/V × head, scale = amax / 448 (the fp8 wire codec's scales)
    int8  S = block_size: one scale per token × layer × K/V × head, scale = amax over head_dim / 127,
          rounded to nearest and clamped to ±127 (the int8 wire codec's scales)

A block is a unit of bytes, so a transfer ships its cells as they are (codec none over the bytes: no
encode, no decode), prefix caching shares them and a fork copies them, scales included.

Writing. int8 rows are quantized one token at a time, so a block's bytes never depend on how its rows
arrived. An fp8 block's scale is the amax of the rows written so far: a write that starts a block
(offset 0) sets it from its own rows; a write that continues a block (a later prefill chunk, a decode
token, an append on the decode actor to the partial last block a prefill actor shipped) raises it to
cover the new rows and re-quantizes the block's earlier rows from their stored values to the new
scale (only when it grew: the factor is exactly 1 otherwise). So every append depends on the stored
block and the new rows alone — the same on the actor that computed the prompt and on the one it was
shipped to — and a block written in one go equals the fp8 wire codec's encoding of its rows.

Reading. Attention dequantizes what it reads (`gather`: rows × their scale in float32, then the model
dtype); the compiled CPU decode kernel does the same inside its loops (`engine.model.attention_compiled`).
Every query attends over K/V as stored, a prompt's own rows included (vLLM's fp8 cache lets a fresh
prompt attend over its unquantized K/V instead): a token's logits then do not depend on whether its
prompt was computed whole, after a prefix-cache hit, on another actor, or replayed after a migration
(int8 also not on the chunking; an fp8 block's scale follows the order its rows were written in).
"""
from __future__ import annotations

import math

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


FP8_BIT_SCALE = 2.0 ** 120    # what `fp8_bits_to_float` leaves out: multiply it into the scale
_FP8_SIGN_AND_MAGNITUDE = 0x87F00000 - (1 << 32)   # bits 31 and 26..20, as a signed int32


def fp8_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values (viewed as int8) -> float32 / 2^120, by two integer ops: widened with its sign to
    int32 and shifted left by 20, the 4 exponent and 3 mantissa bits land on float32's (bits 26..20) and the
    sign's copies fill bits 31..27; the mask keeps bit 31 and bits 26..20. The float32 read there is the e4m3
    value × 2^-120 (bias 127 against 7; an e4m3 subnormal lands on the float32 subnormal of the same ratio).
    CPUs convert float8 one value at a time; these int32 ops vectorize, in eager torch and in the compiled
    decode kernel alike."""
    return ((bits.to(torch.int32) << 20) & _FP8_SIGN_AND_MAGNITUDE).view(torch.float32)


def _inverse(amax: torch.Tensor, top: float) -> torch.Tensor:
    """top / amax, 0 where amax is 0, finite for a subnormal amax (the wire codecs' step)."""
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return inv.clamp_(max=torch.finfo(torch.float32).max)


class KVFormat:
    """The storage of one engine's paged cache: `dtype` auto (the model dtype) or fp8 / int8 (packed cells).

    Args:
        kind: "auto", "fp8" or "int8".
        num_layers, num_kv_heads, block_size, head_dim: the cache's shape.
        dtype: the model dtype (what attention computes in and `gather` returns).
    """

    def __init__(self, kind: str, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype):
        if kind not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache.dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kind!r}")
        self.kind, self.dtype = kind, dtype
        self.num_layers, self.num_kv_heads, self.block_size, self.head_dim = (num_layers, num_kv_heads, block_size,
                                                                             head_dim)
        self.quantized = kind != "auto"
        self.scales_per_head = 1 if kind == "fp8" else block_size           # S (unused for auto)
        self.data_bytes = 2 * num_kv_heads * block_size * head_dim
        self.scale_bytes = 4 * 2 * num_kv_heads * self.scales_per_head
        self.cell_bytes = self.data_bytes + self.scale_bytes                   # one (layer, block), quantized

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype of the stored K/V values."""
        return {"fp8": FP8, "int8": torch.int8}.get(self.kind, self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.quantized:
            return (self.num_layers, num_blocks, self.cell_bytes)
        return (self.num_layers, num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, K and V (scales included)."""
        return self.num_layers * math.prod(self.cache_shape(1)[2:]) * self.storage_dtype.itemsize

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one token takes in the cache, over every layer (its share of a block's scales included)."""
        return self.bytes_per_block / self.block_size

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.storage_dtype, device=device)

    # ---- views of one layer's cache (quantized) ---------------------------
    def split(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """layer_cache [NB, cell_bytes] uint8 -> (data [NB, 2, Hkv, bs, D] value dtype, scales [NB, 2, Hkv, S]
        float32), both views."""
        nb = layer_cache.shape[0]
        data = layer_cache[:, :self.data_bytes].view(self.value_dtype).view(
            nb, 2, self.num_kv_heads, self.block_size, self.head_dim)
        scales = layer_cache[:, self.data_bytes:].view(torch.float32).view(nb, 2, self.num_kv_heads,
                                                                           self.scales_per_head)
        return data, scales

    # ---- write ---------------------------------------------------------------
    def write(self, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor, distinct: bool = False) -> None:
        """Store the step's new rows. k, v: [T, Hkv, D]; blocks, offsets: [T] (the slot of each token).
        `distinct`: no two rows share a block (a pure decode step), so fp8 needs no per-block reduction."""
        if not self.quantized:
            layer_cache[blocks, 0, :, offsets] = k
            layer_cache[blocks, 1, :, offsets] = v
            return
        data, scales = self.split(layer_cache)
        x = torch.stack((k, v), 1).float()                                 # [T, 2, Hkv, D]
        if self.kind == "int8":                                              # (the int8 wire codec's arithmetic)
            amax = x.abs().amax(-1)                                          # [T, 2, Hkv]
            inv = _inverse(amax, INT8_MAX)
            data[blocks, :, :, offsets] = (x * inv[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            scales[blocks, :, :, offsets] = amax / INT8_MAX
            return
        row_amax = x.abs().amax(-1)                                          # [T, 2, Hkv]
        if distinct:                                                         # one row per block: it is the block
            uniq, which, amax, starts = blocks, None, row_amax, offsets == 0
        else:
            uniq, which = torch.unique(blocks, return_inverse=True)
            amax = torch.zeros(len(uniq), 2, self.num_kv_heads, device=x.device).scatter_reduce_(
                0, which[:, None, None].expand_as(row_amax), row_amax, "amax")
            starts = torch.zeros(len(uniq), dtype=torch.bool, device=x.device).index_fill_(
                0, which[offsets == 0], True)
        old = scales[uniq, :, :, 0].masked_fill(starts[:, None, None], 0.0)
        grow = amax / FP8_MAX > old
        new = torch.where(grow, amax / FP8_MAX, old)
        # earlier rows of the blocks whose scale grew are re-quantized to it (a started block has none that count)
        regrown = (grow & (old > 0)).flatten(1).any(1)
        if bool(regrown.any()):
            ids, factor = uniq[regrown], (old / new.clamp(min=torch.finfo(torch.float32).tiny))[regrown]
            data[ids] = (data[ids].float() * torch.where(grow[regrown], factor, 1.0)[..., None, None]).to(FP8)
        scales[uniq, :, :, 0] = new
        # a block that grew (or started) here scales by 448 / amax, as the fp8 wire codec does
        inv = torch.where(grow, _inverse(amax, FP8_MAX), _inverse(old * FP8_MAX, FP8_MAX))        # per block
        inv = inv if which is None else inv[which]                                                # [T, 2, Hkv]
        data[blocks, :, :, offsets] = (x * inv[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)

    # ---- read ----------------------------------------------------------------
    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """data [..., 2, Hkv, bs, D], scales [..., 2, Hkv, S] -> K/V in the model dtype."""
        if self.kind == "fp8":
            return (fp8_bits_to_float(data.view(torch.int8)) * (scales * FP8_BIT_SCALE)[..., None]).to(self.dtype)
        return (data.float() * scales[..., None]).to(self.dtype)

    def gather(self, layer_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The K/V of `block_table` [B, nb], dequantized: [2, Hkv, B, nb * bs, D] in the model dtype."""
        num_seqs, nb = block_table.shape
        data, scales = self.split(layer_cache)
        flat = block_table.reshape(-1)
        x = self.dequantize(data.index_select(0, flat), scales.index_select(0, flat))   # [B * nb, 2, Hkv, bs, D]
        x = x.permute(1, 2, 0, 3, 4)                                                     # [2, Hkv, B * nb, bs, D]
        return x.reshape(2, self.num_kv_heads, num_seqs, nb * self.block_size, self.head_dim)

    def blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The K/V of `block_ids` in every layer of `kv_cache` [L, NB, ...], dequantized: [L, n, 2, Hkv, bs, D]
        in the model dtype."""
        cells = kv_cache.index_select(1, block_ids)
        if not self.quantized:
            return cells
        data, scales = self.split(cells.reshape(-1, self.cell_bytes))
        return self.dequantize(data, scales).view(kv_cache.shape[0], len(block_ids), 2, self.num_kv_heads,
                                                  self.block_size, self.head_dim)
