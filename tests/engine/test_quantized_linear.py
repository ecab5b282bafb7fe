"""The packed int8 / int4 kernels (engine/model/quantized_linear.py) multiply by exactly the weight their
codes stand for: each path (packed kernel, dequantize + GEMM) against a matmul by the dequantized
weight, on odd shapes (output channels not a multiple of 16, odd row counts), float32 and bfloat16."""
from __future__ import annotations

import pytest
import torch

from engine.model import kernel_choice
from engine.model.quantization import quantize
from engine.model.quantized_linear import QuantizedLinear, QuantPlan, cpu_int4_layout_known

SHAPES = [("int8", 40, 96, 128), ("int8", 7, 64, 128), ("int4", 40, 96, 32), ("int4", 100, 256, 64),
          ("int4", 208, 384, 128), ("int4", 16, 64, 32)]


def _module(scheme, n, k, group, kernel_dtype, dense_dtype, seed=0) -> tuple[QuantizedLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = quantize(torch.randn(n, k, generator=gen), scheme, group)
    module = QuantizedLinear(k, n, True, QuantPlan(scheme, group, kernel_dtype, dense_dtype, max_kernel_rows=8))
    with torch.no_grad():
        module.bias.copy_(torch.randn(n, generator=gen))
    module.set_weight(weight)
    return module, weight.dequantize()


@pytest.mark.parametrize("scheme,n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_float32_paths_equal_a_matmul_by_the_dequantized_weight(scheme, n, k, group, rows):
    """rows <= 8 take the packed kernel, more the dense path; both in float32: float rounding only."""
    module, dense = _module(scheme, n, k, group, torch.float32, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ dense.double().T + module.bias.double()
    torch.testing.assert_close(module(x).double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scheme,n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_bfloat16_paths_equal_the_reference_to_bfloat16_rounding(scheme, n, k, group, rows):
    """Activations in bfloat16 (a float32 model's projections on a CPU where bf16 measured faster): the
    result is the dequantized-weight product of the bf16-rounded input, to bfloat16 rounding of the
    terms (the dense path rounds the dequantized weight to bf16) and of the result."""
    module, dense = _module(scheme, n, k, group, torch.bfloat16, torch.bfloat16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.bfloat16().double() @ dense.double().T
    got = module(x).double() - module.bias.double()
    assert got.dtype == torch.float64 and module(x).dtype == torch.float32      # returned in the input's dtype
    terms = x.bfloat16().double().abs() @ dense.double().abs().T
    assert ((got - want).abs() <= 2 ** -8 * terms + 2 ** -8 * want.abs()).all()


def test_both_paths_read_the_same_weight():
    """The dense path's dequantized weight is the codes' weight exactly (float32; no re-rounding)."""
    for scheme, n, k, group in SHAPES:
        module, dense = _module(scheme, n, k, group, torch.float32, torch.float32)
        assert torch.equal(module.dense_weight(torch.float32), dense), (scheme, n, k)


def test_int4_layout_of_this_torch_is_the_one_unpacked():
    assert all(cpu_int4_layout_known(rows) for rows in (16, 48, 64, 80, 112, 208))


def test_nbytes_count_the_packed_weight_and_its_scales():
    int8, _ = _module("int8", 64, 128, 128, torch.bfloat16, torch.float32)
    int4, _ = _module("int4", 64, 128, 32, torch.bfloat16, torch.float32)
    assert int8.nbytes == 64 * 128 + 64 * 2                    # int8 codes + a bf16 scale per channel
    assert int4.nbytes == 64 * 128 // 2 + (128 // 32) * 64 * 2 * 2   # nibbles + bf16 scale and zero per group


def test_a_weight_of_the_wrong_shape_or_scheme_is_refused():
    module = QuantizedLinear(64, 32, False, QuantPlan("int4", 32, torch.float32, torch.float32, 4))
    with pytest.raises(ValueError, match=r"quantized weight has shape \(32, 32\), the projection is \(32, 64\)"):
        module.set_weight(quantize(torch.randn(32, 32), "int4", 32))
    with pytest.raises(ValueError, match="a int8 weight .* cannot fill a int4 projection"):
        module.set_weight(quantize(torch.randn(32, 64), "int8"))
    with pytest.raises(ValueError, match=r"in_features \(96\) to be a multiple of quantization_group_size \(64\)"):
        QuantizedLinear(96, 32, False, QuantPlan("int4", 64, torch.float32, torch.float32, 4))


def test_measured_plan_names_its_choices(tmp_path, monkeypatch):
    """quantized_plan times the dense path's dtype and the row crossover once per machine and shape
    (cached: a second call measures nothing); the packed kernel takes bfloat16 on CPU."""
    from engine.model.config import ModelConfig
    from engine.model.presets import resolve_model
    monkeypatch.setenv(kernel_choice.CACHE_ENV, str(tmp_path / "choices.json"))
    cfg = ModelConfig.from_dir(resolve_model("tiny"))
    plan = kernel_choice.quantized_plan(cfg, "int4", 64, torch.float32, torch.device("cpu"), prefill_tokens=32)
    assert (plan.scheme, plan.group_size) == ("int4", 64)
    assert plan.kernel_dtype == torch.bfloat16 and plan.dense_dtype in (torch.float32, torch.bfloat16)
    assert plan.max_kernel_rows in (0,) + kernel_choice.QUANT_ROWS
    monkeypatch.setattr(kernel_choice, "best_time", lambda fn, repeats=5: pytest.fail("measured again"))
    assert kernel_choice.quantized_plan(cfg, "int4", 64, torch.float32, torch.device("cpu"), prefill_tokens=32) == plan


@pytest.mark.parametrize("block", [64, 32])
def test_int4_unpack_reads_both_cpu_layouts(block):
    """torch packs CPU int4 weights in blocks of 64 channels where its kernels are built for AVX-512 and of 32
    for AVX2 (channel j low, j + block/2 high; the tail channel 2j low, 2j + 1 high): both read back exactly."""
    from engine.model.quantized_linear import unpack_int4_cpu
    rows, k = 2 * block + 16 + 6, 64
    codes = torch.randint(0, 16, (rows, k), generator=torch.Generator().manual_seed(block), dtype=torch.int32)
    wt, full, half = codes.t(), rows // block * block, block // 2               # [K, rows]
    blocks = wt[:, :full].reshape(k, full // block, 2, half)
    packed_full = (blocks[:, :, 0] | blocks[:, :, 1] << 4).transpose(0, 1).reshape(-1)        # [blocks, K, half]
    tail = wt[:, full:].reshape(k, (rows - full) // 2, 2)
    packed = torch.cat([packed_full, (tail[..., 0] | tail[..., 1] << 4).reshape(-1)]).to(torch.uint8)
    out = unpack_int4_cpu(packed.view(rows, k // 2), rows, k, torch.empty(k, rows, dtype=torch.int32), block)
    assert torch.equal(out.t(), codes)
