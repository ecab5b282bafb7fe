"""Weight-only quantization at load (engine/model/quantization.py): round-to-nearest codes, and an
engine whose decoder projections are int8 / int4 computing the model whose weights are the dequantized
ones, while the embedding and the LM head stay as loaded; the KV handshake does not see it."""
from __future__ import annotations

import pytest
import torch
from quantized_support import prompt_logits, small_engine

from engine.model.linear import Linear
from engine.model.quantization import concat, quantize, regroup
from engine.model.quantized_linear import QuantizedLinear
from engine.profile import engine_costs
from kv_transfer import check_compatible, layout_of


@pytest.mark.parametrize("scheme,group,levels", [("int8", 128, 127), ("int4", 32, 7), ("int4", 128, 7)])
def test_round_to_nearest_is_symmetric_and_within_half_a_step(scheme, group, levels):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    q = quantize(w, scheme, group)
    span = 256 if scheme == "int8" else group
    amax = w.abs().view(48, 256 // span, span).amax(-1)
    assert torch.allclose(q.scales, amax / levels, rtol=2 ** -8)                  # scale: amax / levels, bf16
    assert torch.equal(q.scales, q.scales.bfloat16().float())
    assert q.zeros is None if scheme == "int8" else not q.zeros.any()             # symmetric: no zero point
    step = q.scales.repeat_interleave(span, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    codes = q.codes.int() - (0 if scheme == "int8" else 8)
    assert codes.abs().max() == levels


def test_concat_and_regroup_keep_the_weights():
    a, b = torch.randn(16, 128), torch.randn(32, 128)
    qa, qb = quantize(a, "int4", 64), quantize(b, "int4", 64)
    assert torch.equal(concat([qa, qb]).dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))
    assert torch.equal(regroup(qa, 32).dequantize(), qa.dequantize()) and regroup(qa, 32).scales.shape == (16, 4)


@pytest.mark.parametrize("scheme,group", [("int8", 128), ("int4", 64)])
def test_quantized_engine_computes_the_model_of_its_dequantized_weights(tiny_model_dir, float32_plan, scheme, group):
    engine = small_engine(tiny_model_dir, quantization=scheme, quantization_group_size=group)
    reference = small_engine(tiny_model_dir, weight_layout="row-major")    # weights it reads as copied below
    layer = engine.model.layers[0]
    assert engine.quantization == scheme and engine.model.lm_head.weight.dtype == torch.float32
    assert all(isinstance(m, QuantizedLinear) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                        layer.down_proj))
    assert isinstance(engine.model.lm_head, Linear)
    assert torch.equal(engine.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    with torch.no_grad():
        for ref_layer in reference.model.layers:
            for m in (ref_layer.qkv_proj, ref_layer.o_proj, ref_layer.gate_up_proj, ref_layer.down_proj):
                m.weight.copy_(quantize(m.weight, scheme, group).dequantize())
    ids = list(range(5, 45))
    for rows in (ids[:3], ids):               # packed kernel, dense path
        torch.testing.assert_close(prompt_logits(engine, rows), prompt_logits(reference, rows), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scheme,group", [("int8", 128), ("int4", 64)])
def test_quantized_lm_head_computes_the_model_of_its_dequantized_head(tiny_model_dir, float32_plan, scheme, group):
    """quantize_lm_head: the head is one more quantized projection; the embedding stays as loaded."""
    engine = small_engine(tiny_model_dir, quantization=scheme, quantization_group_size=group, quantize_lm_head=True)
    reference = small_engine(tiny_model_dir, weight_layout="row-major")
    assert isinstance(engine.model.lm_head, QuantizedLinear)
    assert torch.equal(engine.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    with torch.no_grad():
        for m in [reference.model.lm_head] + [p for layer in reference.model.layers
                                              for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                        layer.down_proj)]:
            m.weight.copy_(quantize(m.weight, scheme, group).dequantize())
    ids = list(range(5, 45))
    for rows in (ids[:3], ids):
        torch.testing.assert_close(prompt_logits(engine, rows), prompt_logits(reference, rows), atol=2e-5, rtol=2e-5)
    costs = engine_costs(engine)
    head_stored = engine.model.lm_head.nbytes
    assert costs.weight_bytes == engine_costs(small_engine(tiny_model_dir, quantization=scheme,
                                                      quantization_group_size=group)).weight_bytes \
        - costs.head_params * 4 + head_stored


def test_a_tied_head_is_quantized_from_the_embedding_which_stays_exact(float32_plan):
    """pydoc ties its head to the embedding: the quantized head packs its own copy; lookups read the
    embedding as loaded."""
    engine = small_engine("pydoc", quantization="int8", quantize_lm_head=True)
    reference = small_engine("pydoc", weight_layout="row-major")
    assert isinstance(engine.model.lm_head, QuantizedLinear)
    assert torch.equal(engine.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    with torch.no_grad():
        head = Linear(*reversed(reference.model.embed_tokens.weight.shape), bias=False)
        head.weight.copy_(quantize(reference.model.embed_tokens.weight, "int8").dequantize())
        reference.model.lm_head = head                      # untied: the reference's embedding stays exact
        for layer in reference.model.layers:
            for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                m.weight.copy_(quantize(m.weight, "int8").dequantize())
    ids = list(range(5, 45))
    torch.testing.assert_close(prompt_logits(engine, ids), prompt_logits(reference, ids), atol=2e-5, rtol=2e-5)


def test_quantization_changes_neither_fingerprint_nor_kv_layout(tiny_model_dir):
    """An int4 decode engine takes an unquantized prefill engine's KV: the handshake compares the
    weights' fingerprint, KV layout and dtype, none of which quantization changes."""
    prefill, decode = small_engine(tiny_model_dir), small_engine(tiny_model_dir, quantization="int4")
    assert prefill.fingerprint == decode.fingerprint
    check_compatible(layout_of(prefill.kv_cache, prefill.fingerprint).describe("none"),
                     layout_of(decode.kv_cache, decode.fingerprint).describe("none"))
    out = decode.generate(["the cache"], __import__("engine").SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4


def test_decode_bytes_count_the_stored_weights(tiny_model_dir, float32_plan):
    """int8: a byte per weight + a float32 scale per output channel; int4: half a byte + a float32
    scale and zero per group of 128 (the float32 plan); the LM head and norms as before."""
    costs = {q: engine_costs(small_engine(tiny_model_dir, quantization=q)) for q in ("none", "int8", "int4")}
    params = costs["none"].layer_params
    head = costs["none"].weight_bytes - params * 4
    outputs = sum(n for n in (256 + 2 * 128, 256, 2 * 512, 256)) * 4        # tiny: qkv, o, gate_up, down rows
    assert costs["int8"].weight_bytes - head == params + outputs * 4
    assert costs["int4"].weight_bytes - head == params // 2 + params // 128 * 2 * 4


def test_unknown_quantization_and_group_size_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4; got 'int3'"):
        small_engine(tiny_model_dir, quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128; got 48"):
        small_engine(tiny_model_dir, quantization="int4", quantization_group_size=48)
