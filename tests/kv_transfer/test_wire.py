"""Wire format: header checks before allocation, frames, checksums."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kv_transfer.layout import HandshakeError
from kv_transfer.wire import (
    FRAME_PREFIX,
    MAX_HEADER_BYTES,
    WIRE_VERSION,
    ChunkHeader,
    WireError,
    checked_payload,
    checksum,
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


RECEIVER = {"model_fingerprint": "m", "num_layers": 2, "num_kv_heads": 1, "block_size": 4, "head_dim": 2,
            "dtype": "float32", "cache_dtype": "auto", "codec": "none"}


def test_header_round_trip_and_validation():
    h = header()
    assert unpack_header(pack_header(h)) == h
    validate_header(h, RECEIVER)
    with_handoff = header(handoff=b"\x00\xff" * 100)
    assert unpack_header(pack_header(with_handoff)).handoff == with_handoff.handoff


def test_handoff_of_the_wrong_type_is_refused():
    raw = msgpack.packb({**msgpack.unpackb(pack_header(header())), "handoff": "text, not bytes"})
    with pytest.raises(WireError, match="handoff has type str"):
        unpack_header(raw)


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
        ({"num_tokens": 8}, "num_blocks 3 exceeds the 2 blocks its 8 tokens fill"),
        ({"deadline_ms": -1}, "negative"),
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


def test_checked_payload_verifies_the_checksum_before_use():
    payload = bytes(range(40))
    good = checked_payload(header(payload_len=40, checksum=checksum(payload)), payload)
    assert good.dtype == torch.uint8 and bytes(good.numpy()) == payload
    assert torch.equal(checked_payload(header(payload_len=40, checksum=checksum(payload)), good), good)
    with pytest.raises(WireError, match="checksum mismatch in chunk 3"):
        checked_payload(header(payload_len=40, checksum=checksum(payload) ^ 1, chunk_index=3), payload)
    with pytest.raises(WireError, match="chunk 0 carries no checksum"):  # -1, "not computed": fail closed
        checked_payload(header(payload_len=40, checksum=-1), b"\x00" * 40)


def test_the_proto_defines_the_header_the_code_sends():
    """The code's ChunkHeader has exactly the proto's fields (it is built from them), the handshake keys are
    KVLayoutDescription's, and the proto's documented version is the code's."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from kv_transfer.wire import HANDSHAKE_KEYS, WIRE_VERSION, ChunkHeader
    from proto.pdserve.v1 import kv_transfer_pb2
    assert [f.name for f in fields(ChunkHeader)] == [f.name for f in kv_transfer_pb2.ChunkHeader.DESCRIPTOR.fields]
    assert {f.name for f in kv_transfer_pb2.KVLayoutDescription.DESCRIPTOR.fields} == set(HANDSHAKE_KEYS)
    proto = (Path(__file__).resolve().parents[2] / "proto/pdserve/v1/kv_transfer.proto").read_text()
    assert re.search(r"Wire format version \(kv_transfer/wire.py WIRE_VERSION\): (\d+)", proto).group(1) == \
        str(WIRE_VERSION)


def test_int8_header_carries_token_scales_and_its_payload_size():
    """int8's scales are per token x head: the size check before allocation counts them."""
    shape_numel = 2 * 3 * 2 * 1 * 4 * 2                   # [l, n, 2, H, B, D]
    num_scales = 2 * 3 * 2 * 1 * 4                        # [l, n, 2, H, B]
    receiver = {**RECEIVER, "codec": "int8"}
    good = header(codec="int8", scale_layout="token", payload_len=4 * num_scales + shape_numel)
    validate_header(good, receiver)
    assert unpack_header(pack_header(good)) == good
    with pytest.raises(WireError, match="scale layout 'block' does not match codec 'int8'"):
        validate_header(header(codec="int8", scale_layout="block", payload_len=good.payload_len), receiver)
    fp8_sized = 4 * (2 * 3 * 2 * 1) + shape_numel          # one scale per block: too short for int8
    with pytest.raises(WireError, match=f"payload_len {fp8_sized} != {good.payload_len}"):
        validate_header(header(codec="int8", scale_layout="token", payload_len=fp8_sized), receiver)


def test_a_cache_stored_otherwise_is_refused_naming_both():
    stored = header(codec="fp8_cache", scale_layout="block", payload_len=2 * 3 * (2 * 1 * 4 * 2 + 4 * 2))
    with pytest.raises(HandshakeError, match="cache_dtype: sender='fp8' receiver='auto'"):
        validate_header(stored, RECEIVER)
    validate_header(stored, {**RECEIVER, "cache_dtype": "fp8", "codec": "fp8_cache"})
    with pytest.raises(HandshakeError, match="cache_dtype: sender='auto' receiver='int8'"):
        validate_header(header(), {**RECEIVER, "cache_dtype": "int8", "codec": "int8_cache"})


def test_a_codec_the_receiver_does_not_run_is_refused_naming_both():
    with pytest.raises(HandshakeError, match="codec: sender='int8' receiver='fp8'"):
        validate_header(header(codec="int8", scale_layout="token"), {**RECEIVER, "codec": "fp8"})
    with pytest.raises(HandshakeError, match="codec: sender='int4' receiver='none'"):
        validate_header(header(codec="int4", scale_layout="token"), RECEIVER)
