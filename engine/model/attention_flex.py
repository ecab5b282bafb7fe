"""Paged attention through `flex_attention`: prefill and decode read K/V in place, through the block table.

No gather: the layer's cache [NB, 2, Hkv, bs, D] *is* flex's key and value, seen as two strided views
(`paged_views`). Flattened to rows of D, the cache is a run of bs-row slabs (block 0 K head 0, block 0 K
head 1, ..., block 0 V head 0, ..., block 1 K head 0, ...). Key row r of kv head h is flat row r + h * bs,
value row r is flat row r + (Hkv + h) * bs: both [1, Hkv, R, D] with strides (-, bs * D, D, 1) over the same
memory, R = (NB - 1) * 2 * Hkv * bs + bs. Token t of block b sits at row b * 2 * Hkv * bs + t % bs of every
head; rows of other slabs are never visible.

Each step's `BlockMask` (built once per step on the host, shipped in one go: a layer does no host sync)
lists, per query tile, the pages it reads (flex kv-block index = page id * 2 * Hkv, in bs-row units), and
marks the pages every query of the tile sees whole as full (no mask evaluation there). The mask_mod is exact
on its own (flex's eager math ignores the block lists): row r is visible to a query of sequence s at position
p when its page belongs to s (`page_logical[s, page]`, its logical block index, else -1), it is a K row of
the slab (offset < bs), and its position lies in (p - window, p].

Two flex calls per layer: every prefill token of the step packed as one query sequence (tiles of `q_tile`
rows; a tile's pages are the union of its sequences' pages, without a Python loop per sequence in the
layer), and the decode tokens one query per batch entry (flex's decoding kernel on CUDA). Math in the
kernel's precision; exact against the eager SDPA path in float32.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

log = logging.getLogger(__name__)

Q_TILE = 128    # prefill query rows per block-mask tile (flex's default sparse block on CUDA)


def paged_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_cache: [NB, 2, Hkv, bs, D] (contiguous) -> key, value: [1, Hkv, R, D] views, no copy."""
    num_blocks, _, num_kv_heads, block_size, dim = layer_cache.shape
    rows = (num_blocks - 1) * 2 * num_kv_heads * block_size + block_size
    slabs = layer_cache.reshape(-1, dim).unfold(0, rows, block_size)   # [2 * Hkv, D, R]: slab-shifted windows
    return slabs[:num_kv_heads].transpose(1, 2)[None], slabs[num_kv_heads:].transpose(1, 2)[None]


@dataclass(slots=True)
class FlexPart:
    """One flex call of a step: the prefill tokens (packed) or the decode tokens."""
    rows: torch.Tensor | None   # [n] batch rows of these queries; None = every row, in order
    block_mask: BlockMask
    num_padded: int = 0         # decode: batch entries past the n queries (a bucket size: one graph each)
    page_logical: torch.Tensor | None = None   # the mask_mod's tables ([S, NB + 1], [n or B]), for CUDA graphs
    query_pos: torch.Tensor | None = None


@dataclass(slots=True)
class FlexMetadata:
    prefill: FlexPart | None
    decode: FlexPart | None


class _Tiles:
    """Host-side builder of one BlockMask: per tile (query-tile row), its partial and full pages."""

    def __init__(self, num_kv_heads: int):
        self.unit = 2 * num_kv_heads        # flex kv blocks per page
        self.partial: list[list[int]] = []
        self.full: list[list[int]] = []

    def add(self, pages: dict[int, bool]) -> None:
        """pages: page id -> whole page visible to every query of the tile (insertion-ordered, deduplicated)."""
        self.partial.append([p * self.unit for p, whole in pages.items() if not whole])
        self.full.append([p * self.unit for p, whole in pages.items() if whole])

    def tensors(self, batch: int, tiles: int, device: torch.device, width: int = 1) -> tuple[torch.Tensor, ...]:
        """[B, 1, tiles] counts and [B, 1, tiles, W] indices, for the partial then the full pages."""
        out = []
        for lists in (self.partial, self.full):
            longest = max((len(x) for x in lists), default=0)
            if longest > width and width > 1:
                raise ValueError(f"a sequence reads {longest} pages, more than the fixed width {width}")
            idx = torch.zeros(len(lists), max(longest, width), dtype=torch.int32)
            for i, x in enumerate(lists):
                idx[i, :len(x)] = torch.tensor(x, dtype=torch.int32)
            num = torch.tensor([len(x) for x in lists], dtype=torch.int32)
            out += [num.view(batch, 1, tiles).to(device), idx.view(batch, 1, tiles, -1).to(device)]
        return tuple(out)


def _page_logical(tables: list[list[tuple[int, int]]], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[S, NB + 1] int32: logical block index of each page for sequence s, -1 where the page is not s's."""
    width = max(max((len(t) for t in tables), default=0), 1)
    pages = torch.full((len(tables), width), num_blocks, dtype=torch.long)   # padding lands in column NB
    logical = torch.full((len(tables), width), -1, dtype=torch.int32)
    for s, table in enumerate(tables):
        if table:
            logical[s, :len(table)], pages[s, :len(table)] = torch.tensor(table, dtype=torch.long).T
    out = torch.full((len(tables), num_blocks + 1), -1, dtype=torch.int32, device=device)
    return out.scatter_(1, pages.to(device), logical.to(device))


def _mask_mod(page_logical: torch.Tensor, query_seq: torch.Tensor | None, query_pos: torch.Tensor,
              block_size: int, num_kv_heads: int, window: int | None):
    """Exact visibility. query_seq None: the batch index is the sequence (decode), query_pos indexed by b."""
    slab_rows = 2 * num_kv_heads * block_size

    def mask(b, h, q_idx, kv_idx):
        seq, qpos = (b, query_pos[b]) if query_seq is None else (query_seq[q_idx], query_pos[q_idx])
        page = kv_idx // slab_rows
        offset = kv_idx - page * slab_rows
        logical = page_logical[seq, page]
        pos = logical * block_size + offset
        visible = (offset < block_size) & (logical >= 0) & (pos <= qpos)
        if window is not None:
            visible = visible & (pos > qpos - window)
        return visible
    return mask


def decode_bucket(num_seqs: int) -> int:
    """The padded decode batch: the next power of two (a compiled kernel keeps one graph per bucket)."""
    return 1 << (num_seqs - 1).bit_length()


def _window_first(position: int, window: int | None) -> int:
    return 0 if window is None else max(position - window + 1, 0)


def build_flex_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int, num_blocks: int,
                        num_kv_heads: int, device: torch.device, sliding_window: int | None = None,
                        q_tile: int = Q_TILE, pad_decode: bool = False, decode_batch: int | None = None,
                        decode_width: int | None = None) -> FlexMetadata:
    """seqs: (start, num_new, block_table) per sequence, in batch order (as `attention.build_metadata`).

    A sequence with one new token after a cached prefix is a decode query; the rest are prefill chunks
    (fresh or continuing a prefix). `pad_decode`: pad the decode batch to its `decode_bucket` with
    queries that see nothing; `decode_batch` / `decode_width`: pad it to exactly this batch and kv-index
    width (the fixed shapes of a CUDA graph), its padded entries kept in the output.
    """
    rows_total = (num_blocks - 1) * 2 * num_kv_heads * block_size + block_size
    prefill, decode = [], []     # (first batch row, start, num_new, table)
    row = 0
    for start, num_new, table in seqs:
        (decode if num_new == 1 and start > 0 else prefill).append((row, start, num_new, table))
        row += num_new
    all_decode = not prefill

    def pages(table: list[int], first_pos: int, last_pos: int, qlo: int, qhi: int, whole_ok: bool) -> dict:
        """Pages holding keys of queries at positions [qlo, qhi] -> whether all queries see them whole."""
        out = {}
        for j in range(_window_first(first_pos, sliding_window) // block_size, last_pos // block_size + 1):
            out[table[j]] = whole_ok and (j + 1) * block_size - 1 <= qlo and (
                sliding_window is None or j * block_size > qhi - sliding_window)
        return out

    meta = FlexMetadata(None, None)
    if prefill:
        qseq, qpos, batch_rows, tables = [], [], [], []
        for s, (first_row, start, num_new, table) in enumerate(prefill):
            qseq += [s] * num_new
            qpos += range(start, start + num_new)
            batch_rows += range(first_row, first_row + num_new)
            lo = _window_first(start, sliding_window) // block_size
            tables.append([(j, table[j]) for j in range(lo, (start + num_new - 1) // block_size + 1)])
        num_rows = len(qpos)
        num_tiles = -(-num_rows // q_tile)
        tiles = _Tiles(num_kv_heads)
        for t in range(num_tiles):
            lo, hi = t * q_tile, min((t + 1) * q_tile, num_rows) - 1      # packed rows of the tile
            first, last = qseq[lo], qseq[hi]
            tile_pages: dict[int, bool] = {}
            for s in range(first, last + 1):
                _, start, num_new, table = prefill[s]
                qlo = qpos[lo] if qseq[lo] == s else start
                qhi = qpos[hi] if qseq[hi] == s else start + num_new - 1
                for page, whole in pages(table, qlo, qhi, qlo, qhi, first == last).items():
                    tile_pages[page] = tile_pages.get(page, True) and whole
            tiles.add(tile_pages)
        pad = num_tiles * q_tile - num_rows            # tile padding: queries that see nothing
        query_seq = torch.tensor(qseq + [0] * pad, dtype=torch.int32, device=device)
        query_pos = torch.tensor(qpos + [-1] * pad, dtype=torch.long, device=device)
        mask = _mask_mod(_page_logical(tables, num_blocks, device), query_seq, query_pos, block_size,
                         num_kv_heads, sliding_window)
        counts = tiles.tensors(1, num_tiles, device)
        block_mask = BlockMask.from_kv_blocks(*counts, BLOCK_SIZE=(q_tile, block_size), mask_mod=mask,
                                              seq_lengths=(num_rows, rows_total), compute_q_blocks=False)
        contiguous = batch_rows == list(range(num_rows)) and row == num_rows
        meta.prefill = FlexPart(None if contiguous else torch.tensor(batch_rows, dtype=torch.long, device=device),
                                block_mask)
    if decode:
        tiles = _Tiles(num_kv_heads)
        tables = []
        for _, start, _, table in decode:
            tiles.add(pages(table, start, start, start, start, True))
            lo = _window_first(start, sliding_window) // block_size
            tables.append([(j, table[j]) for j in range(lo, start // block_size + 1)])
        num_padded = decode_bucket(len(decode)) - len(decode) if pad_decode else 0
        if decode_batch is not None:
            num_padded = decode_batch - len(decode)
        for _ in range(num_padded):
            tiles.add({})
            tables.append([])
        query_pos = torch.tensor([start for _, start, _, _ in decode] + [-1] * num_padded, dtype=torch.long,
                                 device=device)
        page_logical = _page_logical(tables, num_blocks, device)
        mask = _mask_mod(page_logical, None, query_pos, block_size, num_kv_heads, sliding_window)
        counts = tiles.tensors(len(tables), 1, device, decode_width or 1)
        block_mask = BlockMask.from_kv_blocks(*counts, BLOCK_SIZE=(1, block_size), mask_mod=mask,
                                              seq_lengths=(1, rows_total), compute_q_blocks=False)
        rows = None if all_decode else torch.tensor([r for r, _, _, _ in decode], dtype=torch.long, device=device)
        meta.decode = FlexPart(rows, block_mask, 0 if decode_batch is not None else num_padded, page_logical,
                               query_pos)
    return meta


def _prefill_flex(*args, **kwargs) -> torch.Tensor:     # own code objects: own compile caches
    return flex_attention(*args, **kwargs)


def _decode_flex(*args, **kwargs) -> torch.Tensor:
    return flex_attention(*args, **kwargs)


def _eager_flex(*args, **kwargs) -> torch.Tensor:
    """flex's reference math without its Dynamo wrapper (which retraces at every new query length)."""
    flex_module = sys.modules[flex_attention.__module__]
    saved = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return flex_attention(*args, **kwargs)
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved


class FlexAttention:
    """The paged flex kernel of one engine's cache: compiled by Inductor (Triton, CUDA only), or eager
    (flex's reference math, which scores every row of the pool: CPU tests of the same views, block
    masks and mask_mod, at toy sizes)."""

    def __init__(self, num_blocks: int, num_kv_heads: int, block_size: int, device: torch.device,
                 compile: bool = True, q_tile: int | None = None, max_model_len: int | None = None):
        self.num_blocks, self.num_kv_heads, self.block_size = num_blocks, num_kv_heads, block_size
        # decode page lists padded to the most pages a sequence reads when compiled: one graph per bucket
        self.max_pages = -(-max_model_len // block_size) if max_model_len else None
        self.device = device
        self.compiled = compile
        self.q_tile = q_tile or Q_TILE
        self.kernel_options: dict | None = None
        if compile and device.type == "cuda":
            if block_size % 16:
                raise ValueError(f"flex attention on CUDA needs a block_size that is a multiple of 16; "
                                 f"got {block_size}")
            # Triton tiles of BLOCK_N keys must divide the page (flex's sparse kv block)
            self.kernel_options = {"BLOCK_N": next(n for n in (64, 32, 16) if block_size % n == 0)}
        if compile and device.type != "cuda":
            # torch 2.13's C++ flex template compiles a fixed shape but emits invalid C++ once a query length
            # or batch changes (and wants kv indices as wide as the whole pool): refused rather than broken
            raise ValueError(f"compiled flex attention runs on CUDA only (not {device.type}); "
                             "flex-eager is its reference path")
        # Two compiled entries: prefill with a dynamic query length; decode static per batch bucket
        # (flex's decoding kernel wants a static batch), the batch padded to the bucket.
        self.pad_decode = compile
        if compile:
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 16)   # one graph per bucket
        self._prefill = torch.compile(_prefill_flex, dynamic=True) if compile else _eager_flex
        self._decode = torch.compile(_decode_flex, dynamic=False) if compile else _eager_flex

    def metadata(self, seqs: list[tuple[int, int, list[int]]], sliding_window: int | None,
                 decode_batch: int | None = None, decode_width: int | None = None) -> FlexMetadata:
        if decode_width is None and self.compiled:
            decode_width = self.max_pages
        return build_flex_metadata(seqs, self.block_size, self.num_blocks, self.num_kv_heads, self.device,
                                   sliding_window, self.q_tile, self.pad_decode, decode_batch, decode_width)

    def __call__(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: FlexMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D] (the new tokens; their K/V already written) -> [T, Hq, D]."""
        key, value = paged_views(layer_cache)
        out = None
        for part, decode in ((meta.prefill, False), (meta.decode, True)):
            if part is None:
                continue
            qs = q if part.rows is None else q[part.rows]                   # [n, Hq, D]
            if decode:
                if part.num_padded:
                    qs = torch.cat([qs, qs.new_zeros(part.num_padded, *qs.shape[1:])])
                qs, options = qs[:, :, None, :], None                       # [B, Hq, 1, D]
            else:
                qs, options = qs.transpose(0, 1)[None], self.kernel_options  # [1, Hq, n, D]
            flex = self._decode if decode else self._prefill
            o = flex(qs, key, value, block_mask=part.block_mask, scale=scale, enable_gqa=True, kernel_options=options)
            o = o[:o.shape[0] - part.num_padded, :, 0] if decode else o[0].transpose(0, 1)   # [n, Hq, D]
            if part.rows is None:
                return o
            if out is None:
                out = torch.empty_like(q)
            out[part.rows] = o
        return out

    def warm_up(self, layer_cache: torch.Tensor, num_heads: int, sliding_window: int | None) -> None:
        """Compile now (not on the first request) and check a mixed step against the eager SDPA path."""
        from engine.model.attention import build_metadata, paged_attention
        gen = torch.Generator().manual_seed(0)
        bs, dim = self.block_size, layer_cache.shape[-1]
        if self.num_blocks < 8:
            raise ValueError(f"flex attention's start-up check needs a pool of 8 blocks; got {self.num_blocks}")
        # a fresh prompt, a chunk after a cached prefix, two decodes; blocks 0-7 of the (still unused) pool
        seqs = [(0, bs + 3, [0, 1]), (bs, bs, [2, 3]), (2 * bs, 1, [4, 5, 6]), (bs - 1, 1, [7])]
        num_tokens = sum(n for _, n, _ in seqs)
        with torch.inference_mode():
            layer_cache[:8] = torch.randn(layer_cache[:8].shape, generator=gen).to(layer_cache)
            q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(layer_cache)
            k, v = (torch.randn(num_tokens, self.num_kv_heads, dim, generator=gen).to(layer_cache)
                    for _ in range(2))
            got = paged_attention(q, k, v, layer_cache, build_metadata(
                seqs, bs, layer_cache.device, sliding_window=sliding_window, flex_kernel=self), dim ** -0.5)
            want = paged_attention(q, k, v, layer_cache, build_metadata(
                seqs, bs, layer_cache.device, sliding_window=sliding_window), dim ** -0.5)
            layer_cache[:8] = 0
        tol = 1e-4 if layer_cache.dtype == torch.float32 else 2e-2
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            raise RuntimeError("flex paged attention disagrees with the eager path")


def build(kv_cache: torch.Tensor, num_heads: int, sliding_window: int | None, compile: bool = True,
          max_model_len: int | None = None) -> FlexAttention | None:
    """A checked flex kernel for this cache [L, NB, 2, Hkv, bs, D], or None (cannot compile or disagrees)."""
    _, num_blocks, _, num_kv_heads, block_size, _ = kv_cache.shape
    start = time.perf_counter()
    try:
        kernel = FlexAttention(num_blocks, num_kv_heads, block_size, kv_cache.device, compile,
                               max_model_len=max_model_len)
        kernel.warm_up(kv_cache[0], num_heads, sliding_window)
    except Exception as exc:           # no compiler, Triton/Inductor limitation: the eager path is always right
        log.warning("flex paged attention unavailable (%s: %s); using the eager path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("flex paged attention ready in %.1f s (%s)", time.perf_counter() - start,
             "compiled" if compile else "eager reference")
    return kernel
