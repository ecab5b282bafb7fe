"""Sender-side pipeline: split a transfer into chunks, encode them ahead.

A transfer covers ``kv_cache[layers, block_ids]``. Chunks are
rectangles of (layer, block) cells: several whole layers when a layer's
blocks fit in ``chunk_bytes``, otherwise one layer and a run of blocks.
``pipeline`` encodes the next chunks on worker threads while the transport
sends the current one, so encode, send and decode overlap chunk by chunk.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from kv_transfer.buffers import payload_pool, scratch_pool
from kv_transfer.codec import Codec, pin_transfer_thread
from kv_transfer.interface import KVPiece
from kv_transfer.layout import KVLayout
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, ChunkHeader, host_checksum, pack_header


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int


@dataclass(slots=True)
class EncodedChunk:
    header: ChunkHeader
    header_bytes: bytes
    payload: torch.Tensor  # uint8 [payload_len], on the cache's device

    def release(self) -> None:
        """The payload's bytes are on the wire (or copied): its buffer may be reused."""
        payload_pool.release(self.payload)


@dataclass(frozen=True, slots=True)
class ChunkJob:
    """Gathers, encodes and checksums one chunk when called; ``nbytes``, its payload size, is known before."""

    run: Callable[[], EncodedChunk]
    nbytes: int

    def __call__(self) -> EncodedChunk:
        return self.run()


def plan_chunks(layers: tuple[int, int], num_blocks: int, cell_nbytes: int, chunk_bytes: int,
                blocks: tuple[int, int] | None = None) -> list[ChunkPlan]:
    """Cover [layers) x [blocks) (default [0, num_blocks)) with rectangles of <= chunk_bytes (at least one cell)."""
    layer_start, layer_end = layers
    block_start, block_end = blocks or (0, num_blocks)
    width = block_end - block_start
    cells = max(1, chunk_bytes // max(1, cell_nbytes))
    plans: list[ChunkPlan] = []
    if cells >= width:
        step = cells // width
        for start in range(layer_start, layer_end, step):
            plans.append(ChunkPlan(start, min(start + step, layer_end), block_start, block_end))
    else:
        for layer in range(layer_start, layer_end):
            for start in range(block_start, block_end, cells):
                plans.append(ChunkPlan(layer, layer + 1, start, min(start + cells, block_end)))
    return plans


def piece_nbytes(layers: tuple[int, int], blocks: tuple[int, int], cell_nbytes: int) -> int:
    """Payload bytes of the cells [layers) x [blocks)."""
    return (layers[1] - layers[0]) * (blocks[1] - blocks[0]) * cell_nbytes


MIN_CHUNKS = 8  # enough stages for encode, send and decode to overlap
MIN_CHUNK_BYTES = 1024 * 1024  # below this, per-chunk costs (~1 ms of thread handoffs) dominate


def pipeline_chunk_bytes(total_nbytes: int, chunk_bytes: int) -> int:
    """``chunk_bytes``, shrunk so a transfer has MIN_CHUNKS stages (not below MIN_CHUNK_BYTES)."""
    return min(chunk_bytes, max(MIN_CHUNK_BYTES, total_nbytes // MIN_CHUNKS))


def chunk_header(piece: KVPiece, layout: KVLayout, codec: Codec, plan: ChunkPlan, chunk_index: int,
                 num_chunks: int, payload_len: int, checksum: int, deadline_at: float) -> ChunkHeader:
    """The header of chunk ``chunk_index`` of ``num_chunks`` of ``piece``, covering ``plan``."""
    return ChunkHeader(
        request_id=piece.request_id,
        transfer_id=piece.transfer_id,
        model_fingerprint=layout.model_fingerprint,
        num_layers=layout.num_layers,
        layer_start=plan.layer_start,
        layer_end=plan.layer_end,
        num_blocks=len(piece.block_ids),
        block_start=plan.block_start,
        block_end=plan.block_end,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype_name,
        codec=codec.name,
        scale_layout=codec.scale_layout,
        chunk_index=chunk_index,
        num_chunks=num_chunks,
        payload_len=payload_len,
        checksum=checksum,
        deadline_ms=max(0, int((deadline_at - time.monotonic()) * 1000)),
        num_tokens=piece.num_tokens,
        first_token_id=piece.first_token_id,
        handoff=piece.handoff,
        kv_head_start=layout.kv_head_start,
    )


def piece_plans(piece: KVPiece, cell_nbytes: int, chunk_bytes: int) -> list[ChunkPlan]:
    """The chunks of a resolved ``piece`` (see ``pipeline_chunk_bytes``)."""
    total_nbytes = piece_nbytes(piece.layers, piece.blocks, cell_nbytes)
    return plan_chunks(piece.layers, len(piece.block_ids), cell_nbytes,
                       pipeline_chunk_bytes(total_nbytes, chunk_bytes), piece.blocks)


def encode_jobs(piece: KVPiece, layout: KVLayout, codec: Codec, deadline_at: float,  # time.monotonic()
                chunk_bytes: int) -> list[ChunkJob]:
    """One job per chunk of a resolved ``piece``; each gathers, encodes and checksums its rectangle when called.

    The chunks cover ``kv_cache[layers, block_ids[blocks]]``; their headers index blocks into the whole
    ``block_ids``. Every chunk carries its checksum, taken on a host copy when the cache is on a device,
    since receivers refuse chunks without one.
    """
    kv_cache = piece.kv_cache  # [num_layers, num_blocks, 2, H, B, D]
    cell_shape = (1, 1, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
    plans = piece_plans(piece, codec.payload_nbytes(cell_shape, layout.dtype), chunk_bytes)
    index = torch.tensor(piece.block_ids, dtype=torch.long, device=kv_cache.device)

    def nbytes(plan: ChunkPlan) -> int:
        shape = (plan.layer_end - plan.layer_start, plan.block_end - plan.block_start, *cell_shape[2:])
        return codec.payload_nbytes(shape, layout.dtype)

    def job(chunk_index: int, plan: ChunkPlan) -> EncodedChunk:
        payload = payload_pool.acquire(nbytes(plan), kv_cache.device)
        with scratch_pool.lease() as scratch:
            codec.encode_from(kv_cache, (plan.layer_start, plan.layer_end), index[plan.block_start : plan.block_end],
                              payload, scratch)
        crc = host_checksum(payload)  # on every device: receivers refuse a chunk without one
        header = chunk_header(piece, layout, codec, plan, chunk_index, len(plans), payload.numel(), crc, deadline_at)
        return EncodedChunk(header, pack_header(header), payload)

    return [ChunkJob(functools.partial(job, chunk_index, plan), nbytes(plan)) for chunk_index, plan in enumerate(plans)]


def encode_chunks(piece: KVPiece, layout: KVLayout, codec: Codec, deadline_at: float | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[EncodedChunk]:
    """Encode a piece chunk by chunk on this thread (``deadline_at`` default: ``piece.deadline_s`` from now)."""
    piece = piece.resolved(layout.num_layers)
    deadline_at = time.monotonic() + piece.deadline_s if deadline_at is None else deadline_at
    for job in encode_jobs(piece, layout, codec, deadline_at, chunk_bytes):
        yield job()


def pipeline(jobs: list[Callable], executor: Executor, transform: Callable = lambda item: item,
             depth: int = 3) -> Iterator:
    """Run ``transform(job())`` for each job on ``executor``, at most ``depth`` ahead; yield in order.

    Chunks are independent, so N encoder threads can run N chunks at once
    (senders default to one: on a busy 2-core box a second encoder measured
    slower, and the prefill model needs the cores); each runs torch
    single-threaded (``pin_transfer_thread``). An error surfaces when the
    consumer reaches that chunk; closing the generator cancels what has not
    started. ``depth`` 0 runs each job on the consumer's thread as it asks for
    the chunk: for transports whose sends are asynchronous (torch), which
    overlap the encode of one chunk with the send of the last on their own.
    """

    def run(job):
        pin_transfer_thread()
        return transform(job())

    if len(jobs) == 1 or depth <= 0:  # nothing to overlap, or the consumer overlaps itself: no handoff
        for job in jobs:
            yield run(job)
        return
    pending: deque[Future] = deque()
    try:
        for job in jobs:
            pending.append(executor.submit(run, job))
            if len(pending) >= max(1, depth):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
