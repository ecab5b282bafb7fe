"""Wire format: header checks before allocation, frames, chunk planning."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kv_transfer.chunker import plan_chunks
from kv_transfer.wire import (
    FRAME_PREFIX,
    MAX_HEADER_BYTES,
    WIRE_VERSION,
    ChunkHeader,
    WireError,
    pack_frame,
    pack_header,
    split_frame,
    unpack_header,
    validate_header,
)


def header(**overrides) -> ChunkHeader:
    fields = dict(
        request_id="r1", transfer_id="t1", model_fingerprint="m", num_layers=2, layer_start=0, layer_end=2,
        num_blocks=3, block_start=0, block_end=3, block_size=4, num_kv_heads=1, head_dim=2, dtype="float32",
        codec="none", scale_layout="none", chunk_index=0, num_chunks=1, payload_len=2 * 3 * 2 * 1 * 4 * 2 * 4,
        checksum=-1, deadline_ms=1000,
    )
    fields.update(overrides)
    return ChunkHeader(**fields)


RECEIVER = {"model_fingerprint": "m", "num_layers": 2, "num_kv_heads": 1, "block_size": 4, "head_dim": 2, "dtype": "float32", "codec": "none"}


def test_header_round_trip_and_validation():
    h = header()
    assert unpack_header(pack_header(h)) == h
    validate_header(h, RECEIVER)


def test_unknown_version_is_refused():
    raw = msgpack.packb({**msgpack.unpackb(pack_header(header())), "version": 99})
    with pytest.raises(WireError, match="unknown wire version 99"):
        unpack_header(raw)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xc1garbage", "undecodable"),
        (msgpack.packb([1, 2]), "undecodable"),  # arrays are not allowed at all
        (msgpack.packb({"version": WIRE_VERSION}), "misses"),
        (b"x" * (MAX_HEADER_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_headers(data, message):
    with pytest.raises(WireError, match=message):
        unpack_header(data)


def test_wrong_field_type():
    raw = msgpack.packb({**msgpack.unpackb(pack_header(header())), "num_blocks": "3"})
    with pytest.raises(WireError, match="num_blocks"):
        unpack_header(raw)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"payload_len": 10**12}, "payload_len"),
        ({"payload_len": 8}, "payload_len"),
        ({"layer_end": 3}, "layer range"),
        ({"block_start": 3}, "block range"),
        ({"chunk_index": 1}, "chunk index"),
        ({"scale_layout": "block"}, "scale layout"),
    ],
)
def test_inconsistent_headers_fail_before_allocation(overrides, message):
    with pytest.raises(WireError, match=message):
        validate_header(header(**overrides), RECEIVER)


def test_frames_detect_truncation():
    h = header(payload_len=5)
    frame = pack_frame(pack_header(h), b"abcde")
    parsed, payload = split_frame(frame)
    assert parsed == h and bytes(payload) == b"abcde"
    with pytest.raises(WireError, match="truncated chunk"):
        split_frame(frame[:-1])
    with pytest.raises(WireError, match="truncated frame"):
        split_frame(frame[:2])
    with pytest.raises(WireError, match="header length"):
        split_frame(FRAME_PREFIX.pack(10**6) + b"x")


@pytest.mark.parametrize("layers, num_blocks, cell, chunk", [((0, 4), 10, 100, 350), ((1, 3), 5, 100, 10_000), ((0, 2), 3, 1000, 10), ((0, 5), 4, 64, 64 * 8)])
def test_chunk_plan_covers_every_cell_once(layers, num_blocks, cell, chunk):
    plans = plan_chunks(layers, num_blocks, cell, chunk)
    seen = [(layer, block) for p in plans for layer in range(p.layer_start, p.layer_end) for block in range(p.block_start, p.block_end)]
    assert sorted(seen) == [(layer, block) for layer in range(*layers) for block in range(num_blocks)]
    for p in plans:
        cells = (p.layer_end - p.layer_start) * (p.block_end - p.block_start)
        assert cells == 1 or cells * cell <= chunk


def test_pipeline_chunks_shrink_for_overlap_but_not_below_the_floor():
    from kv_transfer.chunker import MIN_CHUNK_BYTES, pipeline_chunk_bytes

    assert pipeline_chunk_bytes(128 << 20, 4 << 20) == 4 << 20  # big transfers: the configured size
    assert pipeline_chunk_bytes(16 << 20, 4 << 20) == 2 << 20  # 8 stages
    assert pipeline_chunk_bytes(4 << 20, 4 << 20) == MIN_CHUNK_BYTES
    assert pipeline_chunk_bytes(1 << 20, 4 << 20) == MIN_CHUNK_BYTES
    assert pipeline_chunk_bytes(1 << 20, 4096) == 4096  # an explicit small size wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_blocks_into_contiguous_and_strided_caches(dtype):
    from kv_transfer.codec import write_blocks

    data = torch.randn(2, 3, 2, 1, 4, 3).to(dtype)  # [l, n, 2, H, B, D]; odd cell for bf16 words
    index = torch.tensor([4, 0, 2])
    contiguous = torch.zeros(2, 5, 2, 1, 4, 3, dtype=dtype)
    strided = torch.zeros(2, 5, 2, 1, 4, 6, dtype=dtype)[..., :3]  # a view that cannot be flattened
    for cache in (contiguous, strided):
        write_blocks(cache, index, data)
        assert torch.equal(cache[:, [4, 0, 2]], data)
        assert bool((cache[:, [1, 3]] == 0).all())
