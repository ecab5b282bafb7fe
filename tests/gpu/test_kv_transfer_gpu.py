"""kv_transfer on CUDA: codecs on device, gRPC/fake with device caches, NCCL pairs.

Skipped without a CUDA device; the NCCL test needs two GPUs (NCCL refuses
two ranks on one device).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from kv_transfer import (  # noqa: E402
    FakeHub,
    KVLayout,
    KVPiece,
    SimpleBlockPool,
    TransferError,
    TransferStatus,
    get_codec,
    make_receiver,
    make_sender,
)
from kv_transfer.chunker import encode_chunks  # noqa: E402
from kv_transfer.receiver import BaseReceiver  # noqa: E402
from kv_transfer.wire import pack_frame, split_frame  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TOKEN = "gpu-token"
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16,
                  model_fingerprint="gpu-test")


def cache(num_blocks: int, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.cache_shape(num_blocks), generator=generator).to(LAYOUT.dtype).to(device)


@pytest.mark.parametrize("name", ["none", "fp8", "int8", "fp8_tensor"])
def test_codec_on_cuda_matches_cpu(name):
    codec = get_codec(name)
    x = cache(8)[:, [5, 2, 7]]  # [L, n, 2, H, B, D]
    shape = tuple(x.shape)
    out_gpu = torch.empty(codec.payload_nbytes(shape, x.dtype), dtype=torch.uint8, device="cuda")
    out_cpu = torch.empty_like(out_gpu, device="cpu")
    codec.encode(x, out_gpu)
    codec.encode(x.cpu(), out_cpu)
    assert torch.equal(out_gpu.cpu(), out_cpu)
    assert torch.equal(codec.decode(out_gpu, shape, x.dtype).cpu(), codec.decode(out_cpu, shape, x.dtype))


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp"])
@pytest.mark.parametrize("codec", ["none", "fp8", "int8"])
def test_device_caches_round_trip(kind, codec):
    pool = SimpleBlockPool(32)
    pool.take([0, 3])
    dst = torch.zeros(LAYOUT.cache_shape(32), dtype=LAYOUT.dtype, device="cuda")
    extra = {"hub": FakeHub()} if kind == "fake" else {}
    receiver = make_receiver(kind, LAYOUT, dst, pool, codec=codec, token=TOKEN, **extra)
    sender = make_sender(kind, LAYOUT, codec=codec, token=TOKEN, chunk_bytes=1 << 16, **extra)
    try:
        src = cache(16)
        ids = [9, 1, 14, 4]
        handle = sender.send(KVPiece("r", src, ids), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        result = receiver.wait(handle.transfer_id, 10)
        got, expected = dst[:, result.dst_block_ids], src[:, ids]
        if codec == "none":
            assert torch.equal(got, expected)
        else:
            assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 0.04
        assert pool.used_ids == {0, 3, *result.dst_block_ids}
    finally:
        sender.close()
        receiver.close()


def test_chunks_from_a_cuda_cache_carry_checksums_and_corruption_is_refused():
    """Integrity fails closed on CUDA: every chunk of a device cache is checksummed (on a host copy),
    and a corrupted one fails the transfer before it reaches the device cache."""
    pool = SimpleBlockPool(32)
    dst = torch.zeros(LAYOUT.cache_shape(32), dtype=LAYOUT.dtype, device="cuda")
    hub = FakeHub()
    receiver = make_receiver("fake", LAYOUT, dst, pool, codec="none", token=TOKEN, hub=hub)
    sender = make_sender("fake", LAYOUT, codec="none", token=TOKEN, chunk_bytes=1 << 16, hub=hub)
    checksums = []

    def corrupt_chunk_1(frame: bytes) -> bytes:
        header, payload = split_frame(frame)
        checksums.append(header.checksum)
        if header.chunk_index != 1:
            return frame
        corrupted = bytearray(payload)
        corrupted[len(corrupted) // 2] ^= 0x5A
        return pack_frame(frame[4 : len(frame) - len(payload)], bytes(corrupted))

    hub.tamper = corrupt_chunk_1
    try:
        handle = sender.send(KVPiece("r", cache(16), [9, 1, 14, 4]), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.FAILED, handle
        assert "checksum mismatch in chunk 1" in handle.error
        assert len(checksums) >= 2 and min(checksums) >= 0  # no chunk goes out unchecked
        assert receiver.wait(handle.transfer_id, 10).status == TransferStatus.FAILED
        assert pool.num_used == 0
    finally:
        sender.close()
        receiver.close()


def test_a_corrupted_device_payload_is_refused_before_it_is_written():
    """The torch transport receives into device memory on NCCL: such a payload is checked too."""
    pool = SimpleBlockPool(8)
    dst = torch.zeros(LAYOUT.cache_shape(8), dtype=LAYOUT.dtype, device="cuda")
    receiver = BaseReceiver(LAYOUT, dst, pool)
    try:
        chunk = next(encode_chunks(KVPiece("r", cache(4), [0, 1, 2], transfer_id="t"), LAYOUT, get_codec("none"),
                                   deadline_at=time.monotonic() + 30, chunk_bytes=1 << 20))
        assert chunk.payload.is_cuda and chunk.header.checksum >= 0
        payload = chunk.payload.clone()
        payload[payload.numel() // 2] ^= 0x5A
        with pytest.raises(TransferError, match="checksum mismatch in chunk 0"):
            receiver.accept(chunk.header, payload)
        assert receiver.wait("t", 5).status == TransferStatus.FAILED
        assert not bool(dst.any()) and pool.num_used == 0
    finally:
        receiver.close()


def _nccl_receiver(queue, done):
    torch.cuda.set_device(1)
    pool = SimpleBlockPool(16)
    dst = torch.zeros(LAYOUT.cache_shape(16), dtype=LAYOUT.dtype, device="cuda:1")
    receiver = make_receiver("torch", LAYOUT, dst, pool, token=TOKEN)
    queue.put(receiver.endpoint)
    transfer_id = queue.get()
    result = receiver.wait(transfer_id, 60)
    queue.put((result.status.value, dst[:, result.dst_block_ids].cpu()))
    done.wait(60)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs need two GPUs")
def test_nccl_pair_round_trip():
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=_nccl_receiver, args=(queue, done))
    process.start()
    try:
        endpoint = queue.get(timeout=60)
        src = cache(8, device="cuda:0")
        sender = make_sender("torch", LAYOUT, token=TOKEN, device="cuda:0")
        handle = sender.send(KVPiece("r", src, [3, 6, 1]), endpoint)
        queue.put(handle.transfer_id)
        assert handle.wait(60) == TransferStatus.DONE, handle
        status, got = queue.get(timeout=60)
        assert status == "done" and torch.equal(got, src[:, [3, 6, 1]].cpu())
        sender.close()
    finally:
        done.set()
        process.join(30)
        process.kill()
