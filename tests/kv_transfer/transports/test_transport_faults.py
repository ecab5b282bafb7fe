"""Every failure ends cleanly on every transport: status, which side, and every reserved block back in the pool."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

import kv_transfer.sender as sender_module
import kv_transfer.transports.tcp.sender as tcp_sender
from kv_transfer import FailedSide, KVLayout, KVPiece, TransferStatus
from kv_transfer.chunker import ChunkJob

HELPER = os.path.join(os.path.dirname(__file__), "kv_killed_sender.py")


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
def test_deadline_expiry_frees_blocks(make_pair, layout, kind):
    pair = make_pair(kind, layout)
    pair.sender.handshake(pair.dest)  # pair set-up must not eat the short deadline on a busy machine
    src = random_cache(layout, 6)
    handle = pair.sender.send(KVPiece("r", src, [1, 2, 3], transfer_id="t", layers=(0, 1), deadline_s=1.0), pair.dest)
    assert handle.wait(10) == TransferStatus.DONE  # the piece arrived; the other layers never do
    assert pair.pool.num_used == 3
    result = pair.receiver.wait("t", 5)
    assert result.status == TransferStatus.EXPIRED and result.dst_block_ids == []
    assert "deadline" in result.error
    assert_no_leak(pair.pool)
    late = pair.sender.send(KVPiece("r", src, [1, 2, 3], transfer_id="t", layers=(1, 3)), pair.dest)
    assert late.wait(10) == TransferStatus.FAILED and late.failed_side == FailedSide.RECEIVER
    assert "expired" in late.error
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("kind", ["grpc", "tcp", "torch"])
def test_sender_killed_mid_transfer(make_pair, layout, kind):
    pair = make_pair(kind, layout)
    process = subprocess.Popen([sys.executable, HELPER, kind, pair.dest, TOKEN], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "SENT"
        assert wait_for(lambda: pair.receiver.status("killed") == TransferStatus.TRANSFERRING)
        assert pair.pool.num_used == 3
        process.send_signal(signal.SIGKILL)
        result = pair.receiver.wait("killed", 10)  # the deadline is 120 s: this is the broken connection
        assert result.status == TransferStatus.FAILED and result.request_id == "victim"
        assert_no_leak(pair.pool)
    finally:
        process.kill()
        process.wait()


def corrupt_second_chunk(monkeypatch):
    real = sender_module.encode_jobs

    def corrupt(job):
        chunk = job()
        if chunk.header.chunk_index == 1:
            chunk.payload[-1] ^= 0xFF  # after the checksum was taken
        return chunk

    def tampered(*args):
        return [ChunkJob(functools.partial(corrupt, job), job.nbytes) for job in real(*args)]

    monkeypatch.setattr(sender_module, "encode_jobs", tampered)
    corrupt_second_frame_on_the_tcp_wire(monkeypatch)


def corrupt_second_frame_on_the_tcp_wire(monkeypatch):
    """The tcp transport sends codec-none chunks straight from the cache: flip a byte of chunk 1 in flight."""
    real, frames = tcp_sender.send_buffers, []

    def tampered(sock, buffers):
        if len(buffers) > 2:  # a chunk: prefix, header, payload buffers
            frames.append(True)
            if len(frames) == 2:
                last = bytearray(buffers[-1])
                last[-1] ^= 0xFF
                buffers = [*buffers[:-1], last]
        return real(sock, buffers)

    monkeypatch.setattr(tcp_sender, "send_buffers", tampered)


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch", "ray"])
def test_corrupted_chunk_fails_on_checksum(make_pair, layout, kind, monkeypatch):
    pair = make_pair(kind, layout, chunk_bytes=200)
    corrupt_second_chunk(monkeypatch)
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 5), [0, 1, 2, 3]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert handle.failed_side == FailedSide.RECEIVER and "checksum mismatch in chunk 1" in handle.error
    result = pair.receiver.wait(handle.transfer_id, 5)
    assert result.status == TransferStatus.FAILED and "checksum" in result.error
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch", "ray"])
def test_wrong_token_is_rejected_and_counted(make_pair, layout, kind):
    pair = make_pair(kind, layout, sender_token="not-the-token")
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED, handle
    assert handle.failed_side == FailedSide.RECEIVER and "token" in handle.error
    assert pair.receiver.stats.auth_failures >= 1
    assert not bool(pair.dst_cache.any())
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch", "ray"])
def test_mismatched_handshake_names_both_values(make_pair, layout, kind):
    other = KVLayout(layout.num_layers, layout.num_kv_heads, layout.block_size * 2, layout.head_dim, layout.dtype,
                     layout.model_fingerprint)
    pair = make_pair(kind, layout, receiver_layout=other)
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert "block_size" in handle.error and "sender=4" in handle.error and "receiver=8" in handle.error, handle.error
    assert pair.receiver.stats.handshake_failures == 1
    assert_no_leak(pair.pool)


def test_codec_mismatch_is_refused(make_pair, layout):
    pair = make_pair("grpc", layout)
    pair.sender.codec = sender_module.get_codec("fp8")
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0]), pair.dest)
    assert handle.wait(10) == TransferStatus.FAILED
    assert "codec: sender='fp8' receiver='none'" in handle.error


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
@pytest.mark.parametrize("sender_codec, receiver_codec", [("int8", "fp8"), ("fp8", "int8")])
def test_fp8_and_int8_ends_refuse_each_other_naming_both(make_pair, layout, kind, sender_codec, receiver_codec):
    pair = make_pair(kind, layout, codec=receiver_codec)
    pair.sender.codec = sender_module.get_codec(sender_codec)
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert f"codec: sender={sender_codec!r} receiver={receiver_codec!r}" in handle.error, handle.error
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
def test_receiver_out_of_blocks(make_pair, layout, kind):
    pair = make_pair(kind, layout, num_dst_blocks=4)
    pair.pool.take([1, 3])
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 5), [0, 1, 2]), pair.dest)
    assert handle.wait(10) == TransferStatus.FAILED and handle.failed_side == FailedSide.RECEIVER
    assert "no room" in handle.error
    assert_no_leak(pair.pool, [1, 3])


@pytest.mark.parametrize("kind, codec", [(kind, "fp8") for kind in ("fake", "grpc", "tcp", "torch", "ray")]
                         + [("fake", "int8"), ("tcp", "int8")])
def test_nan_in_kv_fails_on_the_sender_side(make_pair, layout, kind, codec):
    pair = make_pair(kind, layout, codec=codec, chunk_bytes=200)
    src = random_cache(layout, 4)
    src[2, 3, 1, 0, 0, 0] = float("nan")  # last layer: earlier chunks were already shipped
    handle = pair.sender.send(KVPiece("r", src, [0, 1, 2, 3]), pair.dest)
    assert handle.wait(10) == TransferStatus.FAILED and handle.failed_side == FailedSide.SENDER
    assert "NaN" in handle.error
    assert pair.receiver.wait(handle.transfer_id, 5).status == TransferStatus.FAILED
    ok = pair.sender.send(KVPiece("r2", random_cache(layout, 4), [0, 1]), pair.dest)  # the link still works
    assert ok.wait(10) == TransferStatus.DONE, ok
    assert_no_leak(pair.pool, pair.receiver.wait(ok.transfer_id, 5).dst_block_ids)
