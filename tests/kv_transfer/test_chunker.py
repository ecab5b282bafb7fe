"""Chunk plans: every (layer, block) cell once, chunks sized for pipelining."""

from __future__ import annotations

import pytest

from kv_transfer.chunker import MIN_CHUNK_BYTES, pipeline_chunk_bytes, plan_chunks


@pytest.mark.parametrize("layers, num_blocks, cell, chunk", [
    ((0, 4), 10, 100, 350), ((1, 3), 5, 100, 10_000), ((0, 2), 3, 1000, 10), ((0, 5), 4, 64, 64 * 8),
])
def test_chunk_plan_covers_every_cell_once(layers, num_blocks, cell, chunk):
    plans = plan_chunks(layers, num_blocks, cell, chunk)
    seen = [(layer, block) for p in plans
            for layer in range(p.layer_start, p.layer_end) for block in range(p.block_start, p.block_end)]
    assert sorted(seen) == [(layer, block) for layer in range(*layers) for block in range(num_blocks)]
    for p in plans:
        cells = (p.layer_end - p.layer_start) * (p.block_end - p.block_start)
        assert cells == 1 or cells * cell <= chunk


def test_pipeline_chunks_shrink_for_overlap_but_not_below_the_floor():
    assert pipeline_chunk_bytes(128 << 20, 4 << 20) == 4 << 20  # big transfers: the configured size
    assert pipeline_chunk_bytes(16 << 20, 4 << 20) == 2 << 20  # 8 stages
    assert pipeline_chunk_bytes(4 << 20, 4 << 20) == MIN_CHUNK_BYTES
    assert pipeline_chunk_bytes(1 << 20, 4 << 20) == MIN_CHUNK_BYTES
    assert pipeline_chunk_bytes(1 << 20, 4096) == 4096  # an explicit small size wins
