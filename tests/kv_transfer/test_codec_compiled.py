"""The compiled fp8 kernels: same payload bounds as the eager codec, no GIL held, eager fallback."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import CodecError, get_codec

SHAPE = (4, 8, 2, 4, 16, 64)  # [l, n, 2, H, B, D]


def built_kernels(cache: torch.Tensor, monkeypatch):
    """The compiled fp8 kernels for ``cache``, built now (the suite pins the eager codec)."""
    from kv_transfer import codec_compiled

    monkeypatch.setenv("PDSERVE_KV_COMPILE", "1")
    codec = get_codec("fp8")
    codec.prepare(cache)
    codec_compiled.wait_ready(600)
    kernels = codec._kernels(cache)
    assert kernels is not None, "the compiled codec did not build"
    return kernels


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fp8_kernels_work_on_the_cache_like_the_eager_codec(dtype, monkeypatch):
    """The fused kernels encode from and decode into scattered cache rows: the payload is within
    the eager codec's bounds, decodes bit-identically to the eager decode, and NaN is refused."""
    codec = get_codec("fp8")
    cache = torch.randn(3, 10, *SHAPE[2:], generator=torch.Generator().manual_seed(3)).to(dtype)  # [L, N, 2, H, B, D]
    cache[1, 4] = 0  # an all-zero block
    built_kernels(cache, monkeypatch)
    layers, index = (1, 3), torch.tensor([7, 4, 0, 9])
    shape = (2, 4, *SHAPE[2:])
    payload = torch.empty(codec.payload_nbytes(shape, dtype), dtype=torch.uint8)
    codec.encode_from(cache, layers, index, payload)
    x = cache[1:3][:, index].float()
    eager = codec.decode(payload, shape, dtype).float()  # the eager decode of the fused payload
    scale = x.abs().amax(dim=(-2, -1), keepdim=True) / 448
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    slack = 2**-7 if dtype == torch.bfloat16 else 1e-6  # the decoded value is rounded to the cache dtype
    assert bool(((eager - x).abs() <= bound * (1 + 1e-5) + x.abs() * slack).all())
    assert bool((eager[0, 1] == 0).all())
    dst = torch.full_like(cache, 7.0)
    dst_index = torch.tensor([2, 8, 5, 1])
    codec.decode_into(payload, shape, dst, layers, dst_index)
    assert torch.equal(dst[1:3][:, dst_index].float(), eager)
    untouched = torch.ones(3, 10, dtype=torch.bool)
    untouched[1:3, dst_index] = False
    assert bool((dst[untouched] == 7.0).all())
    # a payload as gRPC hands it over: read-only bytes at an odd address
    from kv_transfer.wire import readonly_tensor

    odd = readonly_tensor(memoryview(b"\x00" + payload.numpy().tobytes())[1:])
    again = torch.zeros_like(cache)
    codec.decode_into(odd, shape, again, layers, dst_index)
    assert torch.equal(again[1:3][:, dst_index].float(), eager)
    with pytest.raises(CodecError):
        cache[2, 0, 0, 0, 0, 0] = float("nan")
        codec.encode_from(cache, layers, index, payload)


@pytest.mark.slow
def test_no_piece_size_compiles_on_the_transfer_path(monkeypatch):
    """A layer-wise piece of one block is one row, which dynamo specializes: the build covers it,
    so no encode or decode of any row count compiles a graph while a transfer waits."""
    from torch._dynamo.utils import counters

    cache = torch.randn(3, 10, *SHAPE[2:], generator=torch.Generator().manual_seed(5))
    encode_rows, decode_rows = built_kernels(cache, monkeypatch)
    cells = cache.view(30, 2 * SHAPE[3], SHAPE[4] * SHAPE[5])
    graphs = counters["stats"]["unique_graphs"]
    for num_rows in (1, 2, 4, 9, 1):
        rows = torch.arange(num_rows)
        data = torch.empty(num_rows, *cells.shape[1:], dtype=torch.float8_e4m3fn)
        scales = torch.empty(num_rows, cells.shape[1], 1)
        encode_rows(cells, rows, data, scales)
        decode_rows(data, scales, torch.zeros_like(cells), rows)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_kernels_run_without_the_gil(monkeypatch):
    """Inductor's bindings hold the GIL through a kernel; ours release it. A Python loop beside
    a thread that calls the decode kernel back to back kept ~3 % of its pace with the GIL held,
    ~100 % with it released."""
    import threading
    import time

    from kv_transfer import codec_compiled
    from kv_transfer.codec import _rows

    assert codec_compiled.release_gil_in_compiled_kernels()
    cache = torch.randn(4, 64, *SHAPE[2:]).to(torch.bfloat16)
    decode_rows = built_kernels(cache, monkeypatch)[1]
    cells, rows = _rows(cache, (0, 4), torch.arange(64))
    data = torch.zeros(rows.numel(), *cells.shape[1:], dtype=torch.float8_e4m3fn)
    scales = torch.ones(rows.numel(), cells.shape[1], 1)
    stop = threading.Event()

    def decode_back_to_back() -> None:
        while not stop.is_set():
            decode_rows(data, scales, cells, rows)

    def spin(seconds: float) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    alone = spin(0.3)
    worker = threading.Thread(target=decode_back_to_back)
    worker.start()
    try:
        beside = spin(0.3)
    finally:
        stop.set()
        worker.join()
    assert beside > 0.3 * alone, (alone, beside)


def test_without_a_compiler_the_eager_codec_runs(monkeypatch, caplog):
    """A failed build is logged once and leaves the eager codec in place, with the same payload."""
    import logging

    from kv_transfer import codec_compiled

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setenv("PDSERVE_KV_COMPILE", "1")
    monkeypatch.setattr(torch, "compile", no_compiler)
    codec = get_codec("fp8")
    cache = torch.randn(2, 6, 2, 3, 4, 8)  # a cell shape no other test builds
    with caplog.at_level(logging.WARNING, logger="kv_transfer.codec_compiled"):
        codec.prepare(cache)
        assert not codec_compiled.wait_ready(60)
    assert codec._kernels(cache) is None and "no C++ compiler" in caplog.text
    shape, index = (2, 3, 2, 3, 4, 8), torch.tensor([5, 1, 3])
    fused = torch.empty(codec.payload_nbytes(shape, cache.dtype), dtype=torch.uint8)
    codec.encode_from(cache, (0, 2), index, fused)
    plain = torch.empty_like(fused)
    codec.encode(cache[:, index].contiguous(), plain)
    assert torch.equal(fused, plain)
    dst = torch.zeros_like(cache)
    codec.decode_into(fused, shape, dst, (0, 2), index)
    assert torch.equal(dst[:, index], codec.decode(plain, shape, cache.dtype))
