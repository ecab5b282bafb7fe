"""Bit-exact round trips on every transport, hypothesis over shapes and dtypes."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer import KVLayout, KVPiece, TransferStatus

EXAMPLES = {"fake": 25, "grpc": 10, "tcp": 10, "torch": 4, "ray": 3}


@st.composite
def cases(draw):
    layout = KVLayout(
        num_layers=draw(st.integers(1, 4)),
        num_kv_heads=draw(st.integers(1, 3)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        head_dim=draw(st.sampled_from([1, 4, 8, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        model_fingerprint="tiny-test",
    )
    num_src = draw(st.integers(1, 12))
    src_ids = draw(st.lists(st.integers(0, num_src - 1), min_size=1, max_size=num_src, unique=True))
    taken = draw(st.lists(st.integers(0, 23), max_size=10, unique=True))  # forces non-contiguous destinations
    chunk_bytes = draw(st.sampled_from([1, 700, 4096, 1 << 22]))
    return layout, num_src, src_ids, taken, chunk_bytes


def _roundtrip(make_pair, kind, case):
    layout, num_src, src_ids, taken, chunk_bytes = case
    src = random_cache(layout, num_src, seed=len(src_ids))
    pair = make_pair(kind, layout, num_dst_blocks=40, chunk_bytes=chunk_bytes)
    pair.pool.take(taken)
    num_tokens = (len(src_ids) - 1) * layout.block_size + 1  # fewest tokens that fill the blocks (checked)
    handoff = bytes(range(256)) * 3            # opaque bytes for the decode side, in every header
    piece = KVPiece("req", src, src_ids, num_tokens=num_tokens, first_token_id=42, handoff=handoff)
    handle = pair.sender.send(piece, pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert result.status == TransferStatus.DONE and (result.num_tokens, result.first_token_id) == (num_tokens, 42)
    assert result.handoff == handoff
    assert not set(result.dst_block_ids) & set(taken)
    expected = src[:, src_ids]  # [L, n, 2, H, B, D]
    got = pair.dst_cache[:, result.dst_block_ids]
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # exact bytes
    untouched = [b for b in range(40) if b not in result.dst_block_ids]
    assert bool((pair.dst_cache[:, untouched] == 0).all())
    assert_no_leak(pair.pool, list(taken) + result.dst_block_ids)
    pair.close()


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch", "ray"])
def test_none_codec_round_trip_is_bit_exact(make_pair, kind):
    @settings(max_examples=EXAMPLES[kind], deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=cases())
    def run(case):
        _roundtrip(make_pair, kind, case)

    run()


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
@pytest.mark.parametrize("codec", ["none", "fp8", "int8"])
def test_layer_by_layer_equals_one_shot(make_pair, kind, codec, layout):
    src = random_cache(layout, 8, seed=3)
    src_ids = [6, 0, 3, 5]
    one_shot = make_pair(kind, layout, codec=codec, chunk_bytes=200)
    handle = one_shot.sender.send(KVPiece("r", src, src_ids), one_shot.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    first = one_shot.receiver.wait(handle.transfer_id, 10)

    layered = make_pair(kind, layout, codec=codec, chunk_bytes=200)
    handles = [layered.sender.send(KVPiece("r", src, src_ids, transfer_id="t-layers", layers=(layer, layer + 1)),
                                   layered.dest)
               for layer in (2, 0, 1)]
    for h in handles:
        assert h.wait(30) == TransferStatus.DONE, h
    second = layered.receiver.wait("t-layers", 10)
    assert second.status == TransferStatus.DONE
    assert first.dst_block_ids == second.dst_block_ids == [0, 1, 2, 3]
    assert torch.equal(one_shot.dst_cache.view(torch.uint8), layered.dst_cache.view(torch.uint8))


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
@pytest.mark.parametrize("codec", ["none", "fp8", "int8"])
def test_pieces_by_layer_and_block_range_with_a_late_handoff(make_pair, kind, codec, layout):
    """Layer-wise streaming's pieces: (layer, block range) rectangles, in any order, the handoff only in
    the last one: the same cache as one shot, and the handoff of the piece that carried it."""
    src = random_cache(layout, 8, seed=4)
    src_ids = [6, 0, 3, 5, 1]
    one_shot = make_pair(kind, layout, codec=codec, chunk_bytes=200)
    assert one_shot.sender.send(KVPiece("r", src, src_ids), one_shot.dest).wait(30) == TransferStatus.DONE
    pieces = make_pair(kind, layout, codec=codec, chunk_bytes=200)
    early = [((layer, layer + 1), blocks) for layer in (1, 0, 2) for blocks in ((0, 2), (2, 4))]
    early += [((0, 2), (4, 5))]
    handles = [pieces.sender.send(KVPiece("r", src, src_ids, transfer_id="t", layers=layers, blocks=blocks,
                                          num_tokens=20), pieces.dest) for layers, blocks in early]
    for h in handles:
        assert h.wait(30) == TransferStatus.DONE, h
    assert pieces.receiver.status("t") == TransferStatus.TRANSFERRING       # one cell still missing
    last = pieces.sender.send(KVPiece("r", src, src_ids, transfer_id="t", layers=(2, 3), blocks=(4, 5), num_tokens=20,
                                      first_token_id=7, handoff=b"first tokens"), pieces.dest)
    assert last.wait(30) == TransferStatus.DONE, last
    result = pieces.receiver.wait("t", 10)
    assert result.status == TransferStatus.DONE and result.dst_block_ids == [0, 1, 2, 3, 4]
    assert (result.first_token_id, result.handoff, result.num_tokens) == (7, b"first tokens", 20)
    assert torch.equal(one_shot.dst_cache.view(torch.uint8), pieces.dst_cache.view(torch.uint8))


def test_a_bad_block_range_fails_on_the_sender_side(make_pair, layout):
    pair = make_pair("fake", layout)
    src = random_cache(layout, 4)
    for blocks in ((0, 3), (1, 1), (-1, 1)):
        handle = pair.sender.send(KVPiece("r", src, [0, 1], blocks=blocks), pair.dest)
        assert handle.wait(5) == TransferStatus.FAILED and "bad block range" in handle.error
    assert pair.pool.num_used == 0


@pytest.mark.parametrize("kind", ["grpc", "tcp"])
@pytest.mark.parametrize("codec, max_error, wire_ratio", [("fp8", 0.04, 0.53), ("int8", 0.01, 0.56)])
def test_lossy_round_trip_is_close(make_pair, kind, codec, max_error, wire_ratio):
    layout = KVLayout(2, 2, 16, 64, torch.bfloat16, "m")
    pair = make_pair(kind, layout, codec=codec)
    src = random_cache(layout, 6)
    handle = pair.sender.send(KVPiece("r", src, [4, 1]), pair.dest)
    assert handle.wait(10) == TransferStatus.DONE
    result = pair.receiver.wait(handle.transfer_id, 5)
    got, expected = pair.dst_cache[:, result.dst_block_ids].float(), src[:, [4, 1]].float()
    assert float((got - expected).norm() / expected.norm()) < max_error
    assert handle.wire_bytes < wire_ratio * expected.numel() * 2
    assert TOKEN


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
def test_int8_transfer_writes_what_the_codec_round_trip_gives(make_pair, kind, layout):
    """Per-token scales: the decode cache holds exactly ``roundtrip`` of the source blocks, whatever the
    chunking (200-byte chunks split blocks across many chunks)."""
    from kv_transfer import get_codec

    src = random_cache(layout, 8, seed=5)
    src_ids = [6, 0, 3, 5]
    pair = make_pair(kind, layout, codec="int8", chunk_bytes=200)
    handle = pair.sender.send(KVPiece("r", src, src_ids), pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    expected = src.clone()
    get_codec("int8").roundtrip(expected, torch.tensor(src_ids))
    got = pair.dst_cache[:, result.dst_block_ids]
    assert torch.equal(got.view(torch.uint8), expected[:, src_ids].view(torch.uint8))
    assert_no_leak(pair.pool, result.dst_block_ids)
    pair.close()
