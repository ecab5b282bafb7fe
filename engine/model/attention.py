"""Paged attention over the block-table KV cache.

Cache layout (also the KV-transfer wire layout), one tensor over all layers:

    kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]   (dim 2: 0 = K, 1 = V)

or, with `kv_cache.dtype` fp8 / int8, one byte cell per (layer, block) with its scales
(`engine.kv_cache.kv_format`): the step writes and reads it through `AttentionMetadata.kv_format`.

Token `t` of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`. Each step writes the new tokens' K/V through a slot mapping,
then attends: prefill chunks one sequence at a time (causal over cached prefix +
new tokens), decode tokens all together through padded block tables, and short
runs of a few tokens after a cached prefix (speculative decoding's 1 + k tokens)
all together too, padded to the longest run, each query masked causally.

On CUDA (and with `attention="flex"`) the whole step goes through `attention_flex` instead: prefill
and decode read the paged cache in place through flex_attention block masks.

Sliding window (Mistral): a query at position p reads keys in (p - window, p].
Every read starts at the block holding the first key of the window, so block-table
entries before it may be FREED (released by the scheduler) and are never touched.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache.kv_format import KVFormat


@dataclass(slots=True)
class PrefillSeq:
    token_offset: int          # first row of this sequence in the flattened batch
    num_new: int               # tokens computed this step
    start: int                 # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_read] int64: from block `first_block` to the last new token's
    first_block: int = 0       # logical index of block_table[0] (> 0 only with a sliding window)


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor            # [T] block id of every new token
    slot_offsets: torch.Tensor           # [T] offset inside that block
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor | None     # [Bd] rows of decode tokens in the batch
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with block 0)
    decode_bias: torch.Tensor | None     # [Bd, max_blocks * block_size] float32: 0 or -inf past each length;
                                         # None when every decode sequence fills the padded width
    decode_only: bool = False            # every row of the batch is a decode token, in order
    # Short runs after a cached prefix, batched: B runs padded to n queries each (a padded query repeats
    # its run's last row).
    multi_rows: torch.Tensor | None = None    # [B * n] batch rows of the queries
    multi_tables: torch.Tensor | None = None  # [B, width] block tables (padded with block 0)
    multi_mask: torch.Tensor | None = None    # [B, n, width * block_size] bool: key visible to the query
    decode_kernel: Callable | None = None  # reads K/V through the tables (attention_compiled); None = gather
    sliding_window: int | None = None    # keys a query reads: (p - window, p]; None = all of (0, p]
    flex: object | None = None           # attention_flex.FlexMetadata: the whole step through the flex kernel
    flex_kernel: Callable | None = None  # attention_flex.FlexAttention
    kv_format: KVFormat | None = None    # a quantized cache (engine.kv_cache.kv_format); None: the model dtype


MULTI_MAX_TOKENS = 16     # runs of up to this many new tokens after a cached prefix are batched (above)


def window_start(position: int, sliding_window: int | None) -> int:
    """First key position a query at `position` reads."""
    return 0 if sliding_window is None else max(position - sliding_window + 1, 0)


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                   device: torch.device, decode_kernel: Callable | None = None,
                   sliding_window: int | None = None, flex_kernel=None,
                   kv_format: KVFormat | None = None) -> AttentionMetadata:
    """seqs: (start, num_new, block_table) per sequence, in batch order.

    With a `flex_kernel` (attention_flex.FlexAttention) every token of the step attends through it:
    only the slot mapping and the kernel's block masks are built.

    With a `decode_kernel` the decode tables are padded to at least 2 blocks and
    always carry a bias (the compiled kernel keeps one graph for every shape).
    With a `sliding_window` each table is read from the block of its first query's
    window start; the decode bias masks the keys before the window. A quantized `kv_format`
    (fp8 / int8 cache) is written and read through it; flex does not read one (the engine decodes such a cache
    through the compiled kernel on CUDA too).
    """
    if kv_format is not None and not kv_format.quantized:
        kv_format = None
    if flex_kernel is not None:
        blocks, offsets = [], []
        for start, num_new, table in seqs:
            blocks.extend(table[p // block_size] for p in range(start, start + num_new))
            offsets.extend(p % block_size for p in range(start, start + num_new))
        return AttentionMetadata(torch.tensor(blocks, dtype=torch.long, device=device),
                                 torch.tensor(offsets, dtype=torch.long, device=device), [], None, None, None,
                                 sliding_window=sliding_window, flex=flex_kernel.metadata(seqs, sliding_window),
                                 flex_kernel=flex_kernel)
    blocks, offsets, prefills = [], [], []
    decode_rows, decode_tables, decode_spans = [], [], []
    multi: list[tuple[int, int, int, list[int], int]] = []     # (first row, start, num_new, table, first block)
    row = 0
    for start, num_new, table in seqs:
        positions = range(start, start + num_new)
        blocks.extend(table[p // block_size] for p in positions)
        offsets.extend(p % block_size for p in positions)
        first_block = window_start(start, sliding_window) // block_size
        if num_new == 1 and start > 0:
            decode_rows.append(row)
            decode_tables.append(table[first_block: start // block_size + 1])
            base = first_block * block_size   # decode_spans: [lo, hi) of the keys read, in table columns
            decode_spans.append((window_start(start, sliding_window) - base, start + 1 - base))
        elif start > 0 and num_new <= MULTI_MAX_TOKENS:
            needed = (start + num_new + block_size - 1) // block_size
            multi.append((row, start, num_new, table[first_block:needed], first_block))
        else:
            needed = (start + num_new + block_size - 1) // block_size
            prefills.append(PrefillSeq(row, num_new, start, torch.tensor(
                table[first_block:needed], dtype=torch.long, device=device), first_block))
        row += num_new
    meta = AttentionMetadata(
        torch.tensor(blocks, dtype=torch.long, device=device),
        torch.tensor(offsets, dtype=torch.long, device=device),
        prefills, None, None, None, decode_kernel=decode_kernel, sliding_window=sliding_window,
        kv_format=kv_format)
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        if decode_kernel is not None:
            width = max(width, 2)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        meta.decode_only = not prefills and not multi
        if decode_kernel is not None or any(lo > 0 or hi < width * block_size for lo, hi in decode_spans):
            meta.decode_bias = decode_bias(decode_spans, width * block_size, device)
    if multi:
        _multi_metadata(meta, multi, block_size, sliding_window, device)
    return meta


def _multi_metadata(meta: AttentionMetadata, multi: list[tuple[int, int, int, list[int], int]], block_size: int,
                    sliding_window: int | None, device: torch.device) -> None:
    """The batched short runs' query rows, padded block tables and masks."""
    n = max(num_new for _, _, num_new, _, _ in multi)
    width = max(len(table) for *_, table, _ in multi)
    rows, masks = [], []
    cols = torch.arange(width * block_size)
    for first_row, start, num_new, _, first_block in multi:
        queries = [min(j, num_new - 1) for j in range(n)]              # padded queries repeat the last
        rows.extend(first_row + j for j in queries)
        qpos = torch.tensor([start + j for j in queries])
        masks.append(window_mask(qpos, cols + first_block * block_size, sliding_window))
    meta.multi_rows = torch.tensor(rows, dtype=torch.long, device=device)
    meta.multi_tables = torch.tensor([table + [0] * (width - len(table)) for *_, table, _ in multi],
                                     dtype=torch.long, device=device)
    meta.multi_mask = torch.stack(masks).to(device)


def decode_bias(spans: list[tuple[int, int]], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] float32: 0 for the columns in each span [lo, hi), -inf elsewhere."""
    lo, hi = torch.tensor(spans, dtype=torch.long, device=device).reshape(-1, 2).unbind(1)
    cols = torch.arange(width, device=device)
    outside = (cols[None, :] < lo[:, None]) | (cols[None, :] >= hi[:, None])
    return torch.zeros(len(spans), width, device=device).masked_fill_(outside, float("-inf"))


def window_mask(qpos: torch.Tensor, kpos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[n, m] bool: key position kpos[j] is visible to the query at qpos[i] (causal, inside the window)."""
    mask = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        mask &= kpos[None, :] > qpos[:, None] - sliding_window
    return mask


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    # layer_cache: [num_blocks, 2, Hkv, bs, D] (quantized: [num_blocks, cell_bytes]); k, v: [T, Hkv, D]
    if meta.kv_format is not None:
        meta.kv_format.write(layer_cache, k, v, meta.slot_blocks, meta.slot_offsets, distinct=meta.decode_only)
        return
    layer_cache[meta.slot_blocks, 0, :, meta.slot_offsets] = k
    layer_cache[meta.slot_blocks, 1, :, meta.slot_offsets] = v


def gather_kv(layer_cache: torch.Tensor, block_table: torch.Tensor, kv_format: KVFormat | None = None) -> torch.Tensor:
    """One copy of the K/V a batch reads, kv-heads leading (dequantized from a quantized cache).

    block_table: [B, nb] -> [2, Hkv, B, nb * bs, D]. Heads lead so that GQA needs
    no repeat: each kv head's query group attends as one batch entry.
    """
    if kv_format is not None:
        return kv_format.gather(layer_cache, block_table)
    num_seqs, nb = block_table.shape
    src = layer_cache.permute(1, 2, 0, 3, 4)              # [2, Hkv, NB, bs, D] (view)
    x = src.index_select(2, block_table.reshape(-1))      # [2, Hkv, B * nb, bs, D]
    return x.view(2, x.shape[1], num_seqs, nb * x.shape[3], x.shape[4])


def expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[Hkv, T, D] -> [Hkv, group, T, D] as a stride-0 view: GQA without a copy.

    (SDPA's own `enable_gqa` drops CPU to the slow math kernel; this keeps flash.)
    """
    return x[:, None].expand(x.shape[0], group, x.shape[1], x.shape[2])


def grouped_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, n, Hq, D], kv: [2, Hkv, B, T, D], mask: [B, n, T] bool or None -> [B, n, Hq, D]."""
    num_seqs, n, num_heads, dim = q.shape
    num_kv_heads = kv.shape[1]
    group = num_heads // num_kv_heads
    # [B, n, Hkv, g, D] -> [Hkv, B, n * g, D]: the query group rides in the query-length dim
    qg = q.view(num_seqs, n, num_kv_heads, group, dim).permute(2, 0, 1, 3, 4).reshape(
        num_kv_heads, num_seqs, n * group, dim)
    if mask is not None:   # 4-D [1, B, n * g, T]: the shape the CPU flash kernel accepts
        mask = mask[:, :, None, :].expand(num_seqs, n, group, mask.shape[-1]).reshape(1, num_seqs, n * group, -1)
    o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)  # [Hkv, B, n*g, D]
    return o.view(num_kv_heads, num_seqs, n, group, dim).permute(1, 2, 0, 3, 4).reshape(num_seqs, n, num_heads, dim)


def decode_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One new token per sequence. q: [B, Hq, D], kv: [2, Hkv, B, T, D], bias: [B, T] or None -> [B, Hq, D].

    Two batched matmuls and a float32 softmax: with a query this short, plain bmm
    reads the K/V faster than the CPU flash kernel, and the GQA group shares one
    K/V read as the rows of each (kv head, sequence) product.
    """
    num_seqs, num_heads, dim = q.shape
    num_kv_heads, length = kv.shape[1], kv.shape[3]
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, dim).transpose(0, 1).reshape(num_kv_heads * num_seqs, group, dim)
    keys = kv[0].reshape(num_kv_heads * num_seqs, length, dim)
    values = kv[1].reshape(num_kv_heads * num_seqs, length, dim)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(num_kv_heads, num_seqs, group, length).float()
    scores.mul_(scale)
    if bias is not None:
        scores.add_(bias[:, None, :])
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads * num_seqs, group, length)
    o = torch.bmm(probs, values)                                           # [Hkv * B, g, D]
    return o.view(num_kv_heads, num_seqs, group * dim).transpose(0, 1).reshape(num_seqs, num_heads, dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""
    write_kv(layer_cache, k, v, meta)
    if meta.flex_kernel is not None:
        return meta.flex_kernel(q, layer_cache, meta.flex, scale)
    out = torch.empty_like(q)
    for p in meta.prefills:
        rows = slice(p.token_offset, p.token_offset + p.num_new)
        window = meta.sliding_window
        if p.start == 0:      # fresh prompt: attend over its own K/V, causal, no mask
            num_kv_heads = k.shape[1]
            group = q.shape[1] // num_kv_heads
            qs = q[rows].reshape(-1, num_kv_heads, group, q.shape[-1]).permute(1, 2, 0, 3)   # [Hkv, g, n, D]
            if meta.kv_format is None:
                ks, vs = (expand_heads(x[rows].transpose(0, 1), group) for x in (k, v))  # [Hkv, g, n, D]
            else:             # as stored (what every later read of them sees), dequantized
                kv = gather_kv(layer_cache, p.block_table[None], meta.kv_format)[:, :, 0, :p.num_new]
                ks, vs = expand_heads(kv[0], group), expand_heads(kv[1], group)
            if window is None or p.num_new <= window:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            else:
                pos = torch.arange(p.num_new, device=q.device)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=window_mask(pos, pos, window), scale=scale)
            out[rows].view(p.num_new, num_kv_heads, group, -1).copy_(o.permute(2, 0, 1, 3))
        else:                 # continuing a cached prefix: causal with an offset
            block_size = meta.kv_format.block_size if meta.kv_format is not None else layer_cache.shape[3]
            base, total = p.first_block * block_size, p.start + p.num_new
            kv = gather_kv(layer_cache, p.block_table[None], meta.kv_format)[:, :, :, :total - base]
            qpos = torch.arange(p.start, total, device=q.device)
            mask = window_mask(qpos, torch.arange(base, total, device=q.device), window)  # [n, total - base]
            out[rows] = grouped_attention(q[rows][None], kv, mask[None], scale)[0]
    if meta.multi_rows is not None:
        num_runs, n = meta.multi_mask.shape[:2]
        kv = gather_kv(layer_cache, meta.multi_tables, meta.kv_format)              # [2, Hkv, B, T, D]
        o = grouped_attention(q[meta.multi_rows].view(num_runs, n, *q.shape[1:]), kv, meta.multi_mask, scale)
        out[meta.multi_rows] = o.reshape(num_runs * n, *q.shape[1:])              # (padding rewrites a row)
    if meta.decode_rows is not None:
        qd = q if meta.decode_only else q[meta.decode_rows]   # pure-decode step: no row gather/scatter
        if meta.decode_kernel is not None:
            o = meta.decode_kernel(qd, layer_cache, meta.decode_block_tables, meta.decode_bias, scale)
        else:
            kv = gather_kv(layer_cache, meta.decode_block_tables, meta.kv_format)
            o = decode_attention(qd, kv, meta.decode_bias, scale)
        if meta.decode_only:
            return o
        out[meta.decode_rows] = o
    return out
