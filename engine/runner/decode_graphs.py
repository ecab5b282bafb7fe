"""CUDA graphs for pure-decode steps: one graph per padded batch size, captured at start-up, replayed.

Needs the flex kernel (engine/model/attention_flex.py), whose decode call has fixed shapes once the batch is padded
to its bucket (1, 2, 4, ... up to `max_batch`) and the block mask's page lists to a fixed width (the pages
a `max_model_len` sequence reads). Every input of a bucket's step lives in a static buffer: token ids,
positions, slot mapping, the block mask's page counts and lists, and the mask_mod's tables. A step builds
them on the host as usual, copies them into the bucket's buffers and replays the graph: no Python, no
kernel launches per layer, no host sync. Padded entries write their K/V to a scratch block the block
manager never hands out and see no keys; their logits are dropped.

With `capture=False` (CPU, or `cuda_graphs` off) the same static-buffer path runs eagerly: what the CPU
tests check, token for token, against the plain path. Steps with a prefill, prompt logprobs or a batch
above the largest bucket take the plain path.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.model.attention import AttentionMetadata
from engine.model.attention_flex import FlexAttention, decode_bucket

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Bucket:
    input_ids: torch.Tensor        # [B] static inputs ...
    positions: torch.Tensor        # [B]
    meta: AttentionMetadata        # slot mapping + flex block mask, all static tensors
    graph: object | None = None    # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None   # [B, V] the graph's output buffer


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, flex: FlexAttention, max_batch: int,
                 sliding_window: int | None, scratch_block: int, capture: bool):
        self.model, self.kv_cache, self.flex = model, kv_cache, flex
        self.sliding_window = sliding_window
        self.scratch_block = scratch_block
        self.capture = capture
        self.max_batch = decode_bucket(max_batch)
        self.buckets: dict[int, _Bucket] = {}
        self._pool = None

    def accepts(self, seqs: list[tuple[int, int, list[int]]]) -> bool:
        return len(seqs) <= self.max_batch and all(n == 1 and start > 0 for start, n, _ in seqs)

    def _bucket(self, size: int) -> _Bucket:
        bucket = self.buckets.get(size)
        if bucket is None:
            dev = self.kv_cache.device
            dummy = [(1, 1, [self.scratch_block])] * size
            bucket = _Bucket(torch.zeros(size, dtype=torch.long, device=dev),
                             torch.ones(size, dtype=torch.long, device=dev), self._metadata(dummy, size))
            self.buckets[size] = bucket
            if self.capture:
                self._capture(bucket)
        return bucket

    def _metadata(self, seqs: list[tuple[int, int, list[int]]], size: int) -> AttentionMetadata:
        """The step's slot mapping and flex metadata at the bucket's fixed shapes (padded entries: scratch)."""
        bs, dev = self.flex.block_size, self.kv_cache.device
        pad = size - len(seqs)
        blocks = [table[start // bs] for start, _, table in seqs] + [self.scratch_block] * pad
        offsets = [start % bs for start, _, _ in seqs] + [0] * pad
        flex = self.flex.metadata(seqs, self.sliding_window, decode_batch=size, decode_width=self.flex.max_pages)
        return AttentionMetadata(torch.tensor(blocks, dtype=torch.long, device=dev),
                                 torch.tensor(offsets, dtype=torch.long, device=dev), [], None, None, None,
                                 sliding_window=self.sliding_window, flex=flex, flex_kernel=self.flex)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.model(bucket.input_ids, bucket.positions, self.kv_cache, bucket.meta, None)

    def _capture(self, bucket: _Bucket) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                     # compile and autotune outside the capture
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = self._forward(bucket)
        self._pool = graph.pool()
        bucket.graph = graph

    def capture_all(self) -> None:
        """Capture every bucket now, the largest first (smaller ones then reuse its memory pool)."""
        start = time.perf_counter()
        size = self.max_batch
        while size >= 1:
            self._bucket(size)
            size //= 2
        log.info("decode graphs for batch sizes %s ready in %.1f s (%s)", sorted(self.buckets),
                 time.perf_counter() - start, "captured" if self.capture else "static buffers, no capture")

    def run(self, input_ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """A pure-decode step (`accepts`): logits [n, V] float32 of the n sequences, in batch order."""
        num_seqs = len(seqs)
        bucket = self._bucket(decode_bucket(num_seqs))
        size = bucket.input_ids.shape[0]
        dev = self.kv_cache.device
        pad = size - num_seqs
        bucket.input_ids.copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.long, device=dev))
        bucket.positions.copy_(torch.tensor(positions + [1] * pad, dtype=torch.long, device=dev))
        step = self._metadata(seqs, size)
        static, new = bucket.meta, step
        static.slot_blocks.copy_(new.slot_blocks)
        static.slot_offsets.copy_(new.slot_offsets)
        part, new_part = static.flex.decode, new.flex.decode
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            getattr(part.block_mask, name).copy_(getattr(new_part.block_mask, name))
        part.page_logical.copy_(new_part.page_logical)
        part.query_pos.copy_(new_part.query_pos)
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
        else:
            logits = self._forward(bucket)
        return logits[:num_seqs]
