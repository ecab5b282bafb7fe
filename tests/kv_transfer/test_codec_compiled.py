"""The compiled fp8 kernels: same payload bounds as the eager codec, no GIL held, eager fallback."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fp8_kernels_work_on_the_cache_like_the_eager_codec(dtype, monkeypatch):
    """The fused kernels encode from and decode into scattered cache rows: the payload is the eager
    codec's byte for byte, within its bounds, decodes bit-identically to the eager decode, and NaN is refused."""
    codec = get_codec("fp8")
    cache = torch.randn(3, 10, *SHAPE[2:], generator=torch.Generator().manual_seed(3)).to(dtype)  # [L, N, 2, H, B, D]
    cache[1, 4] = 0  # an all-zero block
    built_kernels(cache, monkeypatch)
    layers, index = (1, 3), torch.tensor([7, 4, 0, 9])
    shape = (2, 4, *SHAPE[2:])
    payload = torch.empty(codec.payload_nbytes(shape, dtype), dtype=torch.uint8)
    codec.encode_from(cache, layers, index, payload)
    eager_payload = torch.empty_like(payload)
    codec.encode(cache[1:3][:, index].contiguous(), eager_payload)
    assert torch.equal(payload, eager_payload)  # the same bytes whichever path made them
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_torch_bit_for_bit_on_every_bf16_value(dtype, monkeypatch):
    """Every finite bfloat16 value, in groups of every magnitude (subnormal e4m3 codes, ties, the
    448 edge), any row count (0, the one-row layer-wise piece, many): the C kernels' codes, scales
    and decoded values are torch's own."""
    from kv_transfer import codec_compiled

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    every = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))]
    cells = every[: 63 * 8 * 128].reshape(63, 8, 128).to(dtype)  # [R, G, E]: each group spans magnitudes
    cells[7, 3] = 0  # an all-zero group
    encode_rows, decode_rows = built_kernels(cells.view(63, 1, 2, 4, 16, 8), monkeypatch)
    for num_rows in (0, 1, 2, 63):
        rows = torch.randperm(63, generator=torch.Generator().manual_seed(num_rows))[:num_rows]
        data = torch.empty(num_rows, 8, 128, dtype=torch.float8_e4m3fn)
        scales = torch.empty(num_rows, 8, 1)
        encode_rows(cells, rows, data, scales)
        ref_data, ref_scales = codec_compiled.reference_encode(cells[rows])
        assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
        assert torch.equal(scales, ref_scales)
        out = torch.full_like(cells, 5.0)
        decode_rows(data, scales, out, rows)
        assert torch.equal(out[rows], codec_compiled.reference_decode(data, scales, dtype))
        untouched = torch.ones(63, dtype=torch.bool)
        untouched[rows] = False
        assert bool((out[untouched] == 5.0).all())
    for bad_rows in (torch.tensor([63]), torch.tensor([0, -1])):  # checked before any row is touched
        data = torch.empty(bad_rows.numel(), 8, 128, dtype=torch.float8_e4m3fn)
        scales = torch.empty(bad_rows.numel(), 8, 1)
        with pytest.raises(IndexError):
            encode_rows(cells, bad_rows, data, scales)
        before = cells.clone()
        with pytest.raises(IndexError):
            decode_rows(data, scales, cells, bad_rows)
        assert torch.equal(cells, before)
    rows = torch.tensor([1, 2])
    data, scales = torch.empty(2, 8, 128, dtype=torch.float8_e4m3fn), torch.empty(2, 8, 1)
    for args, wrong in (((cells, rows.int(), data, scales), "rows"), ((cells, rows, data[:1], scales), "data"),
                        ((cells.transpose(1, 2), rows, data, scales), "cells")):
        with pytest.raises(ValueError, match=wrong):
            encode_rows(*args)


def test_compiled_kernels_are_built_once_per_machine_and_reused(monkeypatch, tmp_path):
    """The library is cached under a key of source, compiler and CPU flags; a later process loads it."""
    from kv_transfer import codec_compiled

    monkeypatch.setattr(codec_compiled, "_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(codec_compiled, "_ready", {})
    monkeypatch.setattr(codec_compiled, "_thread", None)
    cache = torch.randn(2, 4, *SHAPE[2:]).to(torch.bfloat16)
    built_kernels(cache, monkeypatch)
    path = codec_compiled.library_path(codec_compiled._compiler())
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]
    mtime = os.stat(path).st_mtime_ns
    monkeypatch.setattr(codec_compiled, "_ready", {})
    monkeypatch.setattr(codec_compiled, "_thread", None)
    built_kernels(cache, monkeypatch)
    assert os.stat(path).st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1


def test_compiled_kernels_run_without_the_gil(monkeypatch):
    """The kernels run without the GIL (ctypes lets go of it), and so do Inductor's once patched.
    A Python loop beside a thread that calls the decode kernel back to back kept ~3 % of its pace
    with the GIL held, ~100 % with it released."""
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

    monkeypatch.setenv("PDSERVE_KV_COMPILE", "1")
    monkeypatch.setattr(codec_compiled, "_compiler", lambda: None)
    monkeypatch.setattr(codec_compiled, "_ready", {})
    monkeypatch.setattr(codec_compiled, "_thread", None)
    codec = get_codec("fp8")
    cache = torch.randn(2, 6, 2, 3, 4, 8)  # a cell shape no other test builds
    with caplog.at_level(logging.WARNING, logger="kv_transfer.codec_compiled"):
        codec.prepare(cache)
        assert not codec_compiled.wait_ready(60)
    assert codec._kernels(cache) is None and "no C compiler" in caplog.text
    shape, index = (2, 3, 2, 3, 4, 8), torch.tensor([5, 1, 3])
    fused = torch.empty(codec.payload_nbytes(shape, cache.dtype), dtype=torch.uint8)
    codec.encode_from(cache, (0, 2), index, fused)
    plain = torch.empty_like(fused)
    codec.encode(cache[:, index].contiguous(), plain)
    assert torch.equal(fused, plain)
    dst = torch.zeros_like(cache)
    codec.decode_into(fused, shape, dst, (0, 2), index)
    assert torch.equal(dst[:, index], codec.decode(plain, shape, cache.dtype))
