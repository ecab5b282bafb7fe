"""Codecs: FP8 and INT8 accuracy, per-block vs per-token vs per-tensor scales, NaN/Inf, wire size, regrouping,
writes into the cache."""

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
    for name in ("fp8", "int8"):
        y, _ = roundtrip(name, x)
        assert bool((y[:, 1] == 0).all()) and bool((y[0, 0, 0, 0] == 0).all())
        assert torch.isfinite(y).all()
    z, _ = roundtrip("fp8_tensor", torch.zeros(SHAPE))
    assert bool((z == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["fp8", "int8", "fp8_tensor"])
def test_nan_and_inf_are_refused(name, bad):
    x = torch.randn(SHAPE)
    x[1, 2, 0, 1, 3, 4] = bad
    with pytest.raises(CodecError, match=f"NaN or Inf; refusing to encode it as {name}"):
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


def _int8_cases() -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(SHAPE) * torch.logspace(-3, 2, SHAPE[1]).view(1, -1, 1, 1, 1, 1)
    x[..., 3] *= 50.0                  # an outlier channel: it sets each row's step
    x[:, 2, :, :, 5, :] = 1e4          # an outlier token: it sets only its own rows' steps
    x[0, 0, 0, 0, 0] = 0.0             # an all-zero row
    return [x]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_error_within_half_a_step_of_its_rows_scale(dtype):
    x = _int8_cases()[0].clamp(-6e4, 6e4).to(dtype)
    y, _ = roundtrip("int8", x)
    assert y.dtype == dtype
    step = x.float().abs().amax(dim=-1, keepdim=True) / 127          # [l, n, 2, H, B, 1]
    out_rounding = 0.0 if dtype == torch.float32 else {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    error = (y.float() - x.float()).abs()
    assert bool((error <= step / 2 * (1 + 1e-5) + x.float().abs() * (1e-6 + out_rounding)).all())
    assert bool((y[0, 0, 0, 0, 0] == 0).all())
    # a row's largest value lands on the grid's end (+-127 steps): it comes back to within rounding
    top = x.float().abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(y.float().gather(-1, top), x.float().gather(-1, top), rtol=1e-6 + out_rounding, atol=0)


def test_int8_payload_is_scales_per_token_and_head_then_int8_data():
    codec = get_codec("int8")
    torch.manual_seed(2)
    x = torch.randn(2, 3, 2, 2, 4, 8)
    out = torch.empty(codec.payload_nbytes(tuple(x.shape), x.dtype), dtype=torch.uint8)
    codec.encode(x, out)
    num_scales = 2 * 3 * 2 * 2 * 4
    assert codec.scales_shape(tuple(x.shape)) == (2, 3, 2, 2, 4)
    assert codec.scales_nbytes(tuple(x.shape)) == 4 * num_scales
    assert out.numel() == 4 * num_scales + x.numel()
    scales = out[:4 * num_scales].view(torch.float32).view(2, 3, 2, 2, 4)
    data = out[4 * num_scales:].view(torch.int8).view(x.shape)
    assert torch.equal(scales, x.abs().amax(dim=-1) / 127)
    assert torch.equal(data, (x * (127 / x.abs().amax(dim=-1, keepdim=True))).round().to(torch.int8))
    assert torch.equal(codec.decode(out, tuple(x.shape), torch.float32), data.float() * scales[..., None])
    assert int(data.abs().amax(dim=-1).min()) == 127 and int(data.min()) >= -127


@pytest.mark.parametrize("dtype, limit", [(torch.bfloat16, 0.532), (torch.float32, 0.266)])
def test_int8_wire_bytes_with_scales(dtype, limit):
    shape = (32, 16, 2, 8, 16, 64)
    codec = get_codec("int8")
    ratio = codec.payload_nbytes(shape, dtype) / (torch.Size(shape).numel() * dtype.itemsize)
    assert ratio == pytest.approx((1 + 4 / 64) / dtype.itemsize) and ratio <= limit
    assert codec.scales_nbytes(shape) == 4 * 32 * 16 * 2 * 8 * 16         # one float32 per token x head


def test_int8_is_more_faithful_than_fp8():
    torch.manual_seed(3)
    x = torch.randn(SHAPE)
    fp8, _ = roundtrip("fp8", x)
    int8, _ = roundtrip("int8", x)
    fp8_error, int8_error = rel_l2(x, fp8), rel_l2(x, int8)
    print(f"relative L2 on gaussian KV: fp8 {fp8_error:.4f}, int8 {int8_error:.4f}")
    assert int8_error < 0.008 and int8_error * 3 < fp8_error        # measured: 0.006 vs 0.026


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_block_and_per_token_scales_make_the_same_bytes_for_any_grouping(name, dtype):
    """A block's bytes do not depend on the other blocks of its chunk, so a cache round trip
    (prompt_kv's recompute) equals the transfer whatever its chunks held."""
    codec = get_codec(name)
    torch.manual_seed(4)
    cache = (torch.randn(3, 7, 2, 2, 4, 16) * torch.logspace(-2, 2, 7).view(1, -1, 1, 1, 1, 1)).to(dtype)
    index = torch.tensor([5, 1, 6, 2])
    whole = cache.clone()
    codec.roundtrip(whole, index)
    pieces = cache.clone()
    for group in (torch.tensor([6]), torch.tensor([2, 5]), torch.tensor([1])):
        codec.roundtrip(pieces, group)
    assert torch.equal(whole.view(torch.uint8), pieces.view(torch.uint8))
    assert torch.equal(whole[:, [0, 3, 4]], cache[:, [0, 3, 4]])              # blocks not named are untouched
    assert not torch.equal(whole[:, index], cache[:, index])                  # lossy: the named ones changed


def test_int8_rows_of_subnormal_values_decode_finite_and_close():
    x = torch.zeros(1, 1, 2, 1, 2, 8)
    x[0, 0, 0, 0, 0, :4] = torch.tensor([1e-40, -3e-41, 0.0, 2e-39])      # float32 subnormals: 127 / amax overflows
    x[0, 0, 1, 0, 1] = torch.linspace(-1, 1, 8)
    y, _ = roundtrip("int8", x)
    assert torch.isfinite(y).all() and bool((y[0, 0, 0, 0, 0].abs() <= 2e-39 * (1 + 1e-6)).all())
    assert float((y - x).abs().max()) <= 1 / 254 * (1 + 1e-5)
