"""KV integrity fails closed on every device: every chunk that reaches a decode cache is checksummed,
whatever device its payload or the sender's cache is on; a mismatch or a missing checksum fails the
transfer and nothing is written.

CUDA is forced on CPU twice: a payload tensor that reports a CUDA device (what the torch transport
receives into on NCCL), and a sender's chunks (it checksums every one; it used to skip CUDA caches).
tests/gpu/test_kv_transfer_gpu.py repeats both on a real device.
"""

from __future__ import annotations

import time

import pytest
import torch
from kv_helpers import assert_no_leak, random_cache

from kv_transfer import FailedSide, KVPiece, SimpleBlockPool, TransferError, TransferStatus
from kv_transfer.chunker import encode_chunks
from kv_transfer.codec import get_codec
from kv_transfer.receiver import BaseReceiver
from kv_transfer.wire import pack_frame, split_frame


class LooksCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the receiver takes its device-payload branch."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def first_chunk(layout):
    return next(encode_chunks(KVPiece("r", random_cache(layout, 3), [0, 1, 2], transfer_id="t"), layout,
                              get_codec("none"), deadline_at=time.monotonic() + 30, chunk_bytes=1 << 20))


@pytest.fixture
def core(layout):
    pool = SimpleBlockPool(8)
    receiver = BaseReceiver(layout, torch.zeros(layout.cache_shape(8), dtype=layout.dtype), pool)
    yield receiver, pool
    receiver.close()


def assert_refused(receiver, pool, header, payload, words: str) -> None:
    with pytest.raises(TransferError, match=words) as refused:
        receiver.accept(header, payload)
    assert refused.value.side == FailedSide.RECEIVER
    result = receiver.wait(header.transfer_id, 1)
    assert result.status == TransferStatus.FAILED and words in result.error
    assert not bool(receiver.kv_cache.any()), "a refused chunk reached the cache"
    assert_no_leak(pool)


def test_a_corrupted_device_payload_is_refused_before_it_is_written(layout, core):
    receiver, pool = core
    chunk = first_chunk(layout)
    payload = chunk.payload.clone()
    payload[payload.numel() // 2] ^= 0x5A  # one flipped byte on the wire
    assert_refused(receiver, pool, chunk.header, payload.as_subclass(LooksCuda), "checksum mismatch in chunk 0")


def test_a_chunk_without_a_checksum_is_refused(layout, core):
    receiver, pool = core
    chunk = first_chunk(layout)
    chunk.header.checksum = -1  # what senders wrote for CUDA caches: "not computed"
    assert_refused(receiver, pool, chunk.header, chunk.payload.numpy().tobytes(), "carries no checksum")


def flip_a_byte_of_chunk(index: int):
    def tamper(frame: bytes) -> bytes:
        header, payload = split_frame(frame)
        if header.chunk_index != index:
            return frame
        corrupted = bytearray(payload)
        corrupted[len(corrupted) // 2] ^= 0x5A
        return pack_frame(frame[4 : len(frame) - len(payload)], bytes(corrupted))

    return tamper


def test_senders_checksum_every_chunk_whatever_the_cache_device(make_pair, layout):
    """The sender has no per-device switch any more (it skipped checksums for CUDA caches); the chunker
    checksums every chunk, on a host copy for device payloads (tests/gpu runs that branch)."""
    pair = make_pair("fake", layout, chunk_bytes=200)
    src = random_cache(layout, 5)
    ok = pair.sender.send(KVPiece("r", src, [0, 1]), pair.dest)
    assert ok.wait(10) == TransferStatus.DONE, ok
    owned = pair.receiver.wait(ok.transfer_id, 5).dst_block_ids
    assert torch.equal(pair.dst_cache[:, owned], src[:, [0, 1]])
    pair.receiver.hub.tamper = flip_a_byte_of_chunk(1)
    handle = pair.sender.send(KVPiece("r", src, [2, 3, 4]), pair.dest)
    assert handle.wait(10) == TransferStatus.FAILED, handle
    assert handle.failed_side == FailedSide.RECEIVER and "checksum mismatch in chunk 1" in handle.error
    assert pair.receiver.wait(handle.transfer_id, 5).status == TransferStatus.FAILED
    assert_no_leak(pair.pool, owned)
