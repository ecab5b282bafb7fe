"""Codecs: FP8 accuracy, per-block vs per-tensor scales, NaN/Inf, wire size, writes into the cache."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import CodecError, get_codec
from kv_transfer.codec import write_blocks

SHAPE = (4, 8, 2, 4, 16, 64)  # [l, n, 2, H, B, D]


def roundtrip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    codec = get_codec(name)
    out = torch.empty(codec.payload_nbytes(tuple(x.shape), x.dtype), dtype=torch.uint8)
    codec.encode(x, out)
    return codec.decode(out, tuple(x.shape), x.dtype), out.numel()


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / x.float().norm())


def test_none_is_bit_exact_for_bfloat16():
    x = torch.randn(SHAPE).to(torch.bfloat16)
    y, nbytes = roundtrip("none", x)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert nbytes == x.numel() * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_within_e4m3_rounding_bound(dtype):
    x = (torch.randn(SHAPE) * torch.logspace(-3, 2, SHAPE[1]).view(1, -1, 1, 1, 1, 1)).to(dtype)
    y, _ = roundtrip("fp8", x)
    scale = x.float().abs().amax(dim=(-2, -1), keepdim=True) / 448
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normals; subnormal step is 2^-9 * scale
    bound = torch.maximum(x.float().abs() * 2**-4, scale * 2**-10)
    slack = 2**-7 if dtype == torch.bfloat16 else 1e-6  # bf16 output rounding
    assert bool(((y.float() - x.float()).abs() <= bound * (1 + 1e-5) + x.float().abs() * slack).all())
    error = rel_l2(x, y)
    print(f"fp8 {dtype} relative L2 error: {error:.4f}")
    assert error < 0.04


def test_per_block_scaling_beats_per_tensor_on_outliers():
    torch.manual_seed(0)
    x = torch.randn(SHAPE) * 0.1
    x[..., 3] *= 50.0  # outlier channel (head_dim index 3 of every head), as in real keys
    x[:, 2, :, :, 5, :] = 1e4  # outlier token (an attention sink) in block 2
    block, _ = roundtrip("fp8", x)
    tensor, _ = roundtrip("fp8_tensor", x)
    normal = torch.ones(SHAPE, dtype=torch.bool)
    normal[:, 2] = False  # judge the ordinary values: not the outlier token's block,
    normal[..., 3] = False  # not the outlier channel
    block_error = rel_l2(x[normal], block[normal])
    tensor_error = rel_l2(x[normal], tensor[normal])
    print(f"relative L2 on ordinary values: per-block {block_error:.4f}, per-tensor {tensor_error:.4f}")
    assert block_error * 4 < tensor_error  # measured: 0.027 vs 0.126


def test_zeros_and_all_zero_blocks_decode_to_zero():
    x = torch.randn(SHAPE)
    x[:, 1] = 0.0
    x[0, 0, 0, 0] = 0.0
    y, _ = roundtrip("fp8", x)
    assert bool((y[:, 1] == 0).all()) and bool((y[0, 0, 0, 0] == 0).all())
    assert torch.isfinite(y).all()
    z, _ = roundtrip("fp8_tensor", torch.zeros(SHAPE))
    assert bool((z == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["fp8", "fp8_tensor"])
def test_nan_and_inf_are_refused(name, bad):
    x = torch.randn(SHAPE)
    x[1, 2, 0, 1, 3, 4] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        roundtrip(name, x)


@pytest.mark.parametrize("dtype, limit", [(torch.bfloat16, 0.52), (torch.float32, 0.26)])
def test_fp8_wire_bytes_with_scales(dtype, limit):
    shape = (32, 16, 2, 8, 16, 128)
    ratio = get_codec("fp8").payload_nbytes(shape, dtype) / (torch.Size(shape).numel() * dtype.itemsize)
    assert ratio <= limit
    # one float32 scale per (layer, block, K/V, head)
    assert get_codec("fp8").scales_nbytes(shape) == 4 * 32 * 16 * 2 * 8


def test_fp8_bit_decode_matches_torch_cast_for_every_code():
    codec = get_codec("fp8")
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn NaN codes are never produced
    shape = (1, 1, 1, 1, 1, codes.numel())
    scale = torch.tensor([0.37], dtype=torch.float32)
    payload = torch.cat([scale.view(torch.uint8), codes])
    expected = codes.view(torch.float8_e4m3fn).float() * scale
    assert torch.equal(codec.decode(payload, shape, torch.float32).flatten(), expected)
    assert torch.equal(codec.decode(payload, shape, torch.bfloat16).flatten(), expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_blocks_into_contiguous_and_strided_caches(dtype):
    data = torch.randn(2, 3, 2, 1, 4, 3).to(dtype)  # [l, n, 2, H, B, D]; odd cell for bf16 words
    index = torch.tensor([4, 0, 2])
    contiguous = torch.zeros(2, 5, 2, 1, 4, 3, dtype=dtype)
    strided = torch.zeros(2, 5, 2, 1, 4, 6, dtype=dtype)[..., :3]  # a view that cannot be flattened
    for cache in (contiguous, strided):
        write_blocks(cache, index, data)
        assert torch.equal(cache[:, [4, 0, 2]], data)
        assert bool((cache[:, [1, 3]] == 0).all())
