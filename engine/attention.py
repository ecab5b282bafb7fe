"""Paged attention over the block-table KV cache.

Cache layout (also the KV-transfer wire layout), one tensor over all layers:

    kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]   (dim 2: 0 = K, 1 = V)

Token `t` of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`. Each step writes the new tokens' K/V through a slot mapping,
then attends: prefill chunks one sequence at a time (causal over cached prefix +
new tokens), decode tokens all together through padded block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    token_offset: int          # first row of this sequence in the flattened batch
    num_new: int               # tokens computed this step
    start: int                 # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_needed] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor            # [T] block id of every new token
    slot_offsets: torch.Tensor           # [T] offset inside that block
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor | None     # [Bd] rows of decode tokens in the batch
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None     # [Bd, 1, 1, max_blocks * block_size] bool


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """seqs: (start, num_new, block_table) per sequence, in batch order."""
    blocks, offsets, prefills = [], [], []
    decode_rows, decode_tables, decode_lens = [], [], []
    row = 0
    for start, num_new, table in seqs:
        positions = range(start, start + num_new)
        blocks.extend(table[p // block_size] for p in positions)
        offsets.extend(p % block_size for p in positions)
        if num_new == 1 and start > 0:
            decode_rows.append(row)
            decode_tables.append(table[: start // block_size + 1])
            decode_lens.append(start + 1)
        else:
            needed = (start + num_new + block_size - 1) // block_size
            prefills.append(PrefillSeq(row, num_new, start,
                                       torch.tensor(table[:needed], dtype=torch.long, device=device)))
        row += num_new
    meta = AttentionMetadata(
        torch.tensor(blocks, dtype=torch.long, device=device),
        torch.tensor(offsets, dtype=torch.long, device=device),
        prefills, None, None, None)
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
        cols = torch.arange(width * block_size, device=device)
        meta.decode_mask = (cols[None, :] < lens[:, None])[:, None, None, :]
    return meta


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    # layer_cache: [num_blocks, 2, Hkv, bs, D]; k, v: [T, Hkv, D]
    layer_cache[meta.slot_blocks, 0, :, meta.slot_offsets] = k
    layer_cache[meta.slot_blocks, 1, :, meta.slot_offsets] = v


def _gather(layer_cache: torch.Tensor, block_table: torch.Tensor, which: int) -> torch.Tensor:
    # block_table: [..., nb] -> [..., Hkv, nb * bs, D]
    x = layer_cache[block_table, which]                  # [..., nb, Hkv, bs, D]
    x = x.transpose(-4, -3)                              # [..., Hkv, nb, bs, D]
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""
    write_kv(layer_cache, k, v, meta)
    out = torch.empty_like(q)
    for p in meta.prefills:
        rows = slice(p.token_offset, p.token_offset + p.num_new)
        qs = q[rows].transpose(0, 1)                     # [Hq, n, D]
        if p.start == 0:
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = p.start + p.num_new
            ks = _gather(layer_cache, p.block_table, 0)[:, :total]   # [Hkv, total, D]
            vs = _gather(layer_cache, p.block_table, 1)[:, :total]
            qpos = torch.arange(p.start, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [n, total]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows].unsqueeze(2)            # [Bd, Hq, 1, D]
        kd = _gather(layer_cache, meta.decode_block_tables, 0)   # [Bd, Hkv, L, D]
        vd = _gather(layer_cache, meta.decode_block_tables, 1)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = o.squeeze(2)
    return out
